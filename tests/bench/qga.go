package main

// The comparison with qemu-guest-agent.
//
// Design: everything runs in ONE VM that carreld boots from the
// qemu-guest-agent variant of the dev image (devimage.Options.WithQemuGA:
// the same kernel, busybox and carrel-agent as /init, plus Debian's
// qemu-ga and its libraries). carreld gives the VM its usual devices,
// including the virtio-serial controller vser0 with carrel's port on it.
// The benchmark then hot-adds, over the VM's QMP socket, two more ports on
// that same controller, each behind a unix socket chardev like carrel's:
//
//	org.qemu.guest_agent.0   qemu-ga serves it (started as root through carrel exec)
//	org.carrel.bench.raw.0   a bare port for the raw stream throughput
//
// So carrel, qemu-ga and the raw port share the machine, memory, vCPU,
// kernel, controller and chardev backend; they differ only in the software
// on each end. Measurements alternate between them, round by round, in the
// same run.

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/digitalocean/go-qemu/qmp"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/image/devimage"
	"github.com/carrel-os/carrel/image/store"
	"github.com/carrel-os/carrel/supervisor/agentlink"
	"github.com/carrel-os/carrel/supervisor/client"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
	"github.com/carrel-os/carrel/tests/harness"
	"github.com/carrel-os/carrel/tests/qga"
)

const (
	qgaImageTag = "dev-qga"
	qgaVMName   = "qga"
	rawPortName = "org.carrel.bench.raw.0"
	// serialBus is the bus of carreld's virtio-serial controller (id vser0).
	serialBus = "vser0.0"
)

// qgaBench is the VM the comparison runs in.
type qgaBench struct {
	d       *harness.Daemon
	c       *client.Client
	vm      string
	dir     string // the variant image is built here
	qgaSock string
	rawSock string
	rawDev  string // guest device node of the raw port
	ga      *qga.Client
	gaVer   string
	qemuPid int
}

// setupQGA builds and stores the qemu-guest-agent variant, boots a VM from
// it through carreld, hot-adds the two ports and starts qemu-ga. Unless the
// bench is nil, close it, even after an error.
func setupQGA(ctx context.Context, d *harness.Daemon, c *client.Client, memory string) (*qgaBench, error) {
	dir, err := os.MkdirTemp("/tmp", "qgab-") // short: sun_path
	if err != nil {
		return nil, err
	}
	b := &qgaBench{d: d, c: c, vm: qgaVMName, dir: dir}

	st, err := store.Open(filepath.Join(d.State, "images"))
	if err != nil {
		return b, err
	}
	res, err := devimage.Build(ctx, devimage.Options{
		CacheDir: harness.CacheDir(), OutDir: filepath.Join(dir, "image"),
		AgentBinary: filepath.Join(d.Bin, "carrel-agent"), WithQemuGA: true,
	})
	if err != nil {
		return b, err
	}
	if _, err := st.Import(filepath.Dir(res.ManifestPath), qgaImageTag); err != nil {
		return b, err
	}
	if dev, err := st.Resolve("dev"); err == nil && dev.Manifest.Kernel != res.Manifest.Kernel {
		return b, fmt.Errorf("the variant's kernel %s differs from the dev image's %s", res.Manifest.Kernel.Digest, dev.Manifest.Kernel.Digest)
	}
	// The comparison drives qemu-ga and the raw port through root shells
	// in the guest, which open the hot-added port devices read-write, and
	// qemu-ga keeps its state, pid file and log in /run: its policy allows
	// root and writing under /dev and /run.
	pol := d.ApplyPolicy("bench-qga", func(s map[string]any) {
		harness.AllowRoot(s)
		fs := s["fs"].(map[string]any)
		fs["read_write"] = append(fs["read_write"].([]any), "/dev", "/run")
	})
	d.Must("vm", "create", b.vm, "--image", qgaImageTag, "--memory", memory, "--cpus", "1", "--policy", pol)
	// The hot-added ports' sockets are QEMU's to make, and a jailed QEMU
	// sees only its VM's directory, as the user it runs as: they go in a
	// directory of that user's there.
	if err := b.socketDir(); err != nil {
		return b, err
	}

	if err := b.hotplug(); err != nil {
		return b, err
	}
	qgaDev, err := b.findPort(ctx, devimage.QemuGAPortName)
	if err != nil {
		return b, err
	}
	if b.rawDev, err = b.findPort(ctx, rawPortName); err != nil {
		return b, err
	}
	// -d: qemu-ga daemonises, and carrel-agent (PID 1) adopts it.
	if _, err := b.root(ctx, `exec "$@"`, devimage.QemuGABinary, "-d", "-m", "virtio-serial", "-p", qgaDev,
		"-t", "/run", "-f", "/run/qemu-ga.pid", "-l", "/run/qemu-ga.log"); err != nil {
		return b, fmt.Errorf("start qemu-ga: %w", err)
	}
	dctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	if b.ga, err = qga.Dial(dctx, b.qgaSock); err != nil {
		log, _ := b.root(ctx, "cat /run/qemu-ga.log")
		return b, fmt.Errorf("%w; qemu-ga log: %s", err, log)
	}
	var info struct {
		Version string `json:"version"`
	}
	if err := b.ga.Call(dctx, "guest-info", nil, &info); err != nil {
		return b, err
	}
	b.gaVer = info.Version
	return b, nil
}

func (b *qgaBench) close() {
	if b.ga != nil {
		b.ga.Close()
	}
	os.RemoveAll(b.dir)
}

// hotplug adds the qemu-ga and raw ports to the running VM through its QMP
// socket. carreld opens QMP only briefly, per operation, so a short
// connection here does not get in its way.
// socketDir makes the sockets' directory in the VM's own, owned by the
// user its QEMU runs as.
func (b *qgaBench) socketDir() error {
	var v struct {
		Pid int `json:"pid"`
	}
	if err := json.Unmarshal([]byte(b.d.Must("vm", "inspect", b.vm)), &v); err != nil || v.Pid == 0 {
		return fmt.Errorf("the QEMU of %s: pid %d, %v", b.vm, v.Pid, err)
	}
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", v.Pid))
	if err != nil {
		return err
	}
	uid, gid := -1, -1
	for l := range strings.Lines(string(status)) {
		f := strings.Fields(l)
		switch {
		case len(f) > 1 && f[0] == "Uid:":
			uid, _ = strconv.Atoi(f[1])
		case len(f) > 1 && f[0] == "Gid:":
			gid, _ = strconv.Atoi(f[1])
		}
	}
	if uid < 0 || gid < 0 {
		return fmt.Errorf("no user in QEMU's /proc/%d/status", v.Pid)
	}
	b.qemuPid = v.Pid
	dir := filepath.Join(b.d.State, "vms", b.vm, "qgab")
	if err := os.Mkdir(dir, 0o700); err != nil {
		return err
	}
	if err := os.Chown(dir, uid, gid); err != nil {
		return err
	}
	b.qgaSock, b.rawSock = filepath.Join(dir, "qga.sock"), filepath.Join(dir, "raw.sock")
	return nil
}

func (b *qgaBench) hotplug() error {
	mon, err := qmp.NewSocketMonitor("unix", filepath.Join(b.d.State, "vms", b.vm, "qmp.sock"), 10*time.Second)
	if err != nil {
		return fmt.Errorf("qmp: %w", err)
	}
	if err := mon.Connect(); err != nil {
		return fmt.Errorf("qmp: %w", err)
	}
	defer mon.Disconnect()
	for _, p := range []struct{ id, sock, name string }{
		{"qga", b.qgaSock, devimage.QemuGAPortName},
		{"raw", b.rawSock, rawPortName},
	} {
		cmds := []map[string]any{
			{"execute": "chardev-add", "arguments": map[string]any{
				"id": p.id, "backend": map[string]any{"type": "socket", "data": map[string]any{
					"addr":   map[string]any{"type": "unix", "data": map[string]any{"path": p.sock}},
					"server": true, "wait": false,
				}},
			}},
			{"execute": "device_add", "arguments": map[string]any{
				"driver": "virtserialport", "bus": serialBus, "chardev": p.id, "name": p.name, "id": p.id + "port",
			}},
		}
		for _, cmd := range cmds {
			j, _ := json.Marshal(cmd)
			if _, err := mon.Run(j); err != nil {
				return fmt.Errorf("qmp %s: %w", cmd["execute"], err)
			}
		}
	}
	return nil
}

// root runs a shell script as root in the guest and returns its stdout.
func (b *qgaBench) root(ctx context.Context, script string, args ...string) (string, error) {
	out, _, err := b.root2(ctx, script, args...)
	return out, err
}

// root2 is root, returning stderr too.
func (b *qgaBench) root2(ctx context.Context, script string, args ...string) (string, string, error) {
	var out, errb bytes.Buffer
	st, err := b.c.Run(ctx, client.Session{VM: b.vm, Stdout: &out, Stderr: &errb,
		Start: &agentv1.ExecRequest{Argv: append([]string{"/bin/sh", "-c", script, "sh"}, args...), User: "root"}})
	if err != nil {
		return "", "", err
	}
	if st.Code != 0 || st.Signal != "" {
		return out.String(), errb.String(), fmt.Errorf("guest script %q: exit %d signal %q: %s", script, st.Code, st.Signal, strings.TrimSpace(errb.String()))
	}
	return out.String(), errb.String(), nil
}

// spawnFloor is what starting and reaping /bin/true costs inside the guest
// (busybox sh, n times in a loop): no agent can return faster than that.
func (b *qgaBench) spawnFloor(ctx context.Context, n int) (time.Duration, error) {
	_, stderr, err := b.root2(ctx, `time sh -c 'i=0; while [ $i -lt "$1" ]; do /bin/true; i=$((i+1)); done' sh "$1"`, strconv.Itoa(n))
	if err != nil {
		return 0, err
	}
	// busybox time: "real\t0m 1.23s"
	for _, line := range strings.Split(stderr, "\n") {
		f := strings.Fields(line)
		if len(f) == 3 && f[0] == "real" {
			m, err1 := strconv.Atoi(strings.TrimSuffix(f[1], "m"))
			sec, err2 := strconv.ParseFloat(strings.TrimSuffix(f[2], "s"), 64)
			if err1 == nil && err2 == nil {
				return time.Duration((float64(m)*60 + sec) * float64(time.Second) / float64(n)), nil
			}
		}
	}
	return 0, fmt.Errorf("no time in %q", stderr)
}

// findPort waits until the hot-added port named name has a device node.
func (b *qgaBench) findPort(ctx context.Context, name string) (string, error) {
	const script = `for p in /sys/class/virtio-ports/*; do
	[ "$(cat "$p/name" 2>/dev/null)" = "$1" ] && [ -c "/dev/${p##*/}" ] && { echo "/dev/${p##*/}"; exit 0; }
done
exit 1`
	deadline := time.Now().Add(30 * time.Second)
	for {
		out, err := b.root(ctx, script, name)
		if err == nil {
			return strings.TrimSpace(out), nil
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("port %s never appeared in the guest: %w", name, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// carrelExec runs argv through VMService.Exec (server streaming) and
// returns the exit code.
func carrelExec(ctx context.Context, c *client.Client, vm string, argv ...string) (int32, error) {
	s, err := c.VMs.Exec(ctx, connect.NewRequest(&apiv1.ExecRequest{Vm: vm, Argv: argv}))
	if err != nil {
		return 0, err
	}
	defer s.Close()
	for s.Receive() {
		if x := s.Msg().GetExit(); x != nil {
			if x.Signal != "" {
				return 0, fmt.Errorf("killed by %s", x.Signal)
			}
			return x.Code, nil
		}
	}
	if err := s.Err(); err != nil {
		return 0, err
	}
	return 0, errors.New("exec stream ended without an exit status")
}

// carrelRun runs argv through the client's Run (AgentService.Process, the
// bidirectional stream the CLI uses) and returns the exit code. With
// noStdin, as the CLI without -i, carreld carries the command on the
// link's Commands stream; without, on a Process stream of its own.
func carrelRun(ctx context.Context, c *client.Client, vm string, noStdin bool, argv ...string) (int32, error) {
	st, err := c.Run(ctx, client.Session{VM: vm, Start: &agentv1.ExecRequest{Argv: argv, NoStdin: noStdin}})
	if err != nil {
		return 0, err
	}
	return st.Code, nil
}

// benchExec compares the round trip of `true`.
func (b *qgaBench) benchExec(ctx context.Context, n int) error {
	minClient, err := buildMinClient()
	if err != nil {
		return err
	}
	defer os.RemoveAll(filepath.Dir(minClient))
	type side struct {
		name string
		part bool // a part of carrel's round trip, not a way to exec
		run  func() error
		lat  []time.Duration
		vcpu time.Duration // the guest's vCPU time over all of lat
	}
	polls := 0
	sides := []*side{
		{name: "carrel, Go client, VMService.Exec", run: func() error {
			code, err := carrelExec(ctx, b.c, b.vm, "true")
			if err == nil && code != 0 {
				err = fmt.Errorf("exit %d", code)
			}
			return err
		}},
		{name: "carrel, Go client, Run (no stdin)", run: func() error {
			code, err := carrelRun(ctx, b.c, b.vm, true, "true")
			if err == nil && code != 0 {
				err = fmt.Errorf("exit %d", code)
			}
			return err
		}},
		// A command with output: its start, output and exit status.
		{name: "part: Run of `echo hi` (no stdin, output)", part: true, run: func() error {
			code, err := carrelRun(ctx, b.c, b.vm, true, "echo", "hi")
			if err == nil && code != 0 {
				err = fmt.Errorf("exit %d", code)
			}
			return err
		}},
		// With stdin open, a command takes a link stream of its own.
		{name: "carrel, Go client, Run (stdin open)", run: func() error {
			code, err := carrelRun(ctx, b.c, b.vm, false, "true")
			if err == nil && code != 0 {
				err = fmt.Errorf("exit %d", code)
			}
			return err
		}},
		{name: "carrel, CLI (`carrel exec`, its start too)", run: func() error {
			if r := b.d.Carrel("exec", b.vm, "--", "true"); r.Code != 0 {
				return fmt.Errorf("exit %d: %s", r.Code, r.Stderr)
			}
			return nil
		}},
		// The floor under any CLI: a new Go process that makes a client and
		// runs the command (tests/bench/minclient), and nothing else.
		{name: "floor: a minimal Go client process", part: true, run: func() error {
			return runMinClient(ctx, minClient, b.d.Socket, b.vm, "true")
		}},
		// Parts of carrel's round trip, for where its time goes: the API
		// alone (no guest), one unary call through the link (policy and
		// audit for a file read, no process), and the exec route up to the
		// guest's program lookup (decided, recorded, no process).
		{name: "part: API only (VMService.GetVM)", part: true, run: func() error {
			_, err := b.c.VMs.GetVM(ctx, connect.NewRequest(&apiv1.GetVMRequest{Name: b.vm}))
			return err
		}},
		{name: "part: link round trip (Files.Stat of /tmp)", part: true, run: func() error {
			_, err := b.c.Stat(ctx, b.vm, "/tmp")
			return err
		}},
		{name: "part: exec route, no process (not found)", part: true, run: func() error {
			_, err := carrelRun(ctx, b.c, b.vm, true, "/nonexistent/true")
			if connect.CodeOf(err) == connect.CodeNotFound {
				return nil
			}
			return fmt.Errorf("want not found, got %v", err)
		}},
		{name: "qemu-ga, guest-exec + guest-exec-status", run: func() error {
			st, p, err := b.ga.Run(ctx, "/bin/true")
			polls += p
			if err == nil && (st.ExitCode == nil || *st.ExitCode != 0) {
				err = fmt.Errorf("status %+v", st)
			}
			return err
		}},
	}
	for _, s := range sides { // warm up each path
		for range 3 {
			if err := s.run(); err != nil {
				return fmt.Errorf("%s: %w", s.name, err)
			}
		}
	}
	polls = 0
	for i := range n {
		for j := range sides {
			s := sides[(i+j)%len(sides)] // rotate who goes first
			before, err := readQEMUThreads("/proc", b.qemuPid)
			if err != nil {
				return err
			}
			start := time.Now()
			if err := s.run(); err != nil {
				return fmt.Errorf("%s: %w", s.name, err)
			}
			s.lat = append(s.lat, time.Since(start))
			after, err := readQEMUThreads("/proc", b.qemuPid)
			if err != nil {
				return err
			}
			s.vcpu += after.vcpus.run - before.vcpus.run
		}
	}
	fmt.Printf("\nexec round trips (of `true` unless named), same VM, %d runs of each, interleaved:\n", n)
	for _, s := range sides {
		extra := ""
		if strings.HasPrefix(s.name, "qemu-ga") {
			extra = fmt.Sprintf("   (%.1f status polls per run, each sent as soon as the last said not exited)", float64(polls)/float64(n))
		}
		fmt.Printf("  %-42s p50 %9s   p99 %9s   guest vCPU %7s per run%s\n", s.name, fmtDur(median(s.lat)), fmtDur(percentile(s.lat, 99)),
			fmtDur(s.vcpu/time.Duration(n)), extra)
	}
	qs := sides[len(sides)-1]
	q := median(qs.lat)
	floor, err := b.spawnFloor(ctx, 200)
	if err != nil {
		fmt.Printf("  (in-guest spawn floor not measured: %v)\n", err)
	} else {
		fmt.Printf("  %-42s mean %8s   (a busybox sh loop in the guest: the floor under any agent)\n", "in-guest fork+exec+wait of /bin/true", fmtDur(floor))
	}
	// Targets (issue 16), for the Go client: p50 within 4 ms of the floor
	// and at most half qemu-ga's, p99 at most twice p50; the CLI within
	// 4 ms of the Go client.
	var process, cli, minimal *side
	for _, s := range sides {
		switch {
		case strings.Contains(s.name, "Run (no stdin)"):
			process = s
		case strings.Contains(s.name, "CLI"):
			cli = s
		case strings.Contains(s.name, "minimal Go client"):
			minimal = s
		}
	}
	for _, s := range sides[:len(sides)-1] {
		if s.part || s == cli {
			continue
		}
		p50, p99 := median(s.lat), percentile(s.lat, 99)
		line := fmt.Sprintf("  %-42s %.2fx qemu-ga's p50 (target <= 0.5x: %s), p99/p50 %.1f (target <= 2: %s)",
			strings.TrimPrefix(s.name, "carrel, ")+":", float64(p50)/float64(q), verdict(2*p50 <= q), float64(p99)/float64(p50), verdict(p99 <= 2*p50))
		if floor > 0 {
			over := p50 - floor
			line += fmt.Sprintf(", %s over the floor (target <= 4ms: %s)", fmtDur(over), verdict(over <= 4*time.Millisecond))
		}
		fmt.Println(line)
	}
	if process != nil && cli != nil && minimal != nil {
		extra := median(cli.lat) - median(process.lat)
		fmt.Printf("  %-42s %s over the Go client's p50 (target <= 4ms: %s)\n", "the CLI (its start, a new connection):", fmtDur(extra), verdict(extra <= 4*time.Millisecond))
		// What any new Go process and connection cost here, and the CLI's
		// own share beyond that.
		fmt.Printf("  %-42s %s over the Go client's p50 (a new Go process, client and connection on this machine)\n", "a minimal Go client process:", fmtDur(median(minimal.lat)-median(process.lat)))
		fmt.Printf("  %-42s %s over the minimal Go client process's p50\n", "the CLI's own share:", fmtDur(median(cli.lat)-median(minimal.lat)))
	}
	return nil
}

// benchFiles compares file write (host to guest) and read (guest to host)
// throughput with each other and with the raw port.
func (b *qgaBench) benchFiles(ctx context.Context, size int64, rounds, chunk int) error {
	// Random content, so no layer can compress it; made before any timing.
	data := make([]byte, size)
	rng := rand.NewChaCha8([32]byte{'c', 'a', 'r', 'r', 'e', 'l'})
	rng.Read(data)
	back := bytes.NewBuffer(make([]byte, 0, size))

	const carrelPath, qgaPath, rawPath = "/tmp/bench-carrel", "/tmp/bench-qga", "/tmp/bench-raw"
	type series struct{ write, read []float64 }
	var car, ga, raw, rawFile series
	// What QEMU's main loop and vCPU did during carrel's transfers and
	// raw+file's: where a transfer waits that the throughput alone hides.
	type watches struct{ write, read threadWatch }
	carThreads := watches{threadWatch{pid: b.qemuPid}, threadWatch{pid: b.qemuPid}}
	rawThreads := watches{threadWatch{pid: b.qemuPid}, threadWatch{pid: b.qemuPid}}

	carrelRound := func() error {
		var el time.Duration
		if err := carThreads.write.around(func() error {
			start := time.Now()
			_, err := b.c.Upload(ctx, b.vm, carrelPath, bytes.NewReader(data), 0o644)
			el = time.Since(start)
			return err
		}); err != nil {
			return fmt.Errorf("carrel upload: %w", err)
		}
		car.write = append(car.write, mibps(size, el))
		back.Reset()
		if err := carThreads.read.around(func() error {
			start := time.Now()
			_, err := b.c.Download(ctx, b.vm, carrelPath, back)
			el = time.Since(start)
			return err
		}); err != nil {
			return fmt.Errorf("carrel download: %w", err)
		}
		car.read = append(car.read, mibps(size, el))
		if !bytes.Equal(back.Bytes(), data) {
			return fmt.Errorf("carrel download: %d bytes differ from the %d uploaded", back.Len(), size)
		}
		_, err := b.root(ctx, `rm -f "$1"`, carrelPath)
		return err
	}
	qgaRound := func() error {
		start := time.Now()
		if _, err := b.ga.WriteFile(ctx, qgaPath, bytes.NewReader(data), chunk); err != nil {
			return fmt.Errorf("qemu-ga write: %w", err)
		}
		ga.write = append(ga.write, mibps(size, time.Since(start)))
		back.Reset()
		start = time.Now()
		if _, err := b.ga.ReadFile(ctx, qgaPath, back, chunk); err != nil {
			return fmt.Errorf("qemu-ga read: %w", err)
		}
		ga.read = append(ga.read, mibps(size, time.Since(start)))
		if !bytes.Equal(back.Bytes(), data) {
			return fmt.Errorf("qemu-ga read: %d bytes differ from the %d written", back.Len(), size)
		}
		_, err := b.root(ctx, `rm -f "$1"`, qgaPath)
		return err
	}
	// The raw port twice: the bare stream (/dev/null and /dev/zero), and
	// the stream into and out of a file in the same tmpfs, which is what
	// the file APIs do and the part of their cost no protocol can remove.
	rawRound := func() error {
		for _, s := range []struct {
			dst, src string
			into     *series
			threads  *watches // nil: not watched
		}{{"/dev/null", "/dev/zero", &raw, nil}, {rawPath, rawPath, &rawFile, &rawThreads}} {
			var ww, rw *threadWatch
			if s.threads != nil {
				ww, rw = &s.threads.write, &s.threads.read
			}
			var w, r float64
			if err := ww.around(func() (err error) {
				w, err = b.rawToGuest(ctx, data, s.dst)
				return err
			}); err != nil {
				return fmt.Errorf("raw port, host to guest %s: %w", s.dst, err)
			}
			if err := rw.around(func() (err error) {
				r, err = b.rawFromGuest(ctx, size, s.src)
				return err
			}); err != nil {
				return fmt.Errorf("raw port, guest to host from %s: %w", s.src, err)
			}
			s.into.write, s.into.read = append(s.into.write, w), append(s.into.read, r)
		}
		_, err := b.root(ctx, `rm -f "$1"`, rawPath)
		return err
	}

	// The first write of a fresh VM's RAM is slower, whoever does it: 79
	// MiB/s for carrel's first 128 MiB upload against 124-154 for the next
	// three, and 125 MiB/s for a first raw+file write, after which carrel's
	// first upload ran at 150. Round 1 starts with carrel's upload, so
	// without this the VM's first use of its memory counted against carrel
	// alone. Each round removes its file before the next transfer, so one
	// file size of memory is what the rounds reuse.
	if _, err := b.root(ctx, `dd if=/dev/zero of=/tmp/bench-warm bs=1M count="$1" status=none && rm -f /tmp/bench-warm`,
		strconv.FormatInt(size>>20, 10)); err != nil {
		return fmt.Errorf("touch the guest's memory first: %w", err)
	}
	fmt.Printf("\nfile throughput, %d MiB of random bytes, same VM, %d rounds, interleaved, after %d MiB written to the guest's /tmp and removed, untimed (MiB/s; qemu-ga with %d KiB per guest-file-read/-write):\n",
		size>>20, rounds, size>>20, chunk>>10)
	for i := range rounds {
		order := []func() error{carrelRound, qgaRound, rawRound}
		if i%2 == 1 {
			order = []func() error{rawRound, qgaRound, carrelRound}
		}
		for _, f := range order {
			if err := f(); err != nil {
				return err
			}
		}
		fmt.Printf("  round %d: write carrel %.1f, qemu-ga %.1f, raw %.1f, raw+file %.1f; read carrel %.1f, qemu-ga %.1f, raw %.1f, raw+file %.1f\n", i+1,
			car.write[i], ga.write[i], raw.write[i], rawFile.write[i], car.read[i], ga.read[i], raw.read[i], rawFile.read[i])
	}
	fmt.Printf("  %-22s %8s %8s %9s %9s %15s %11s %16s\n", "median MiB/s", "carrel", "qemu-ga", "raw port", "raw+file", "carrel/qemu-ga", "carrel/raw", "carrel/raw+file")
	for _, row := range []struct {
		name       string
		c, q, r, f []float64
	}{
		{"write (host -> guest)", car.write, ga.write, raw.write, rawFile.write},
		{"read  (guest -> host)", car.read, ga.read, raw.read, rawFile.read},
	} {
		c, q, r, f := medianFloat(row.c), medianFloat(row.q), medianFloat(row.r), medianFloat(row.f)
		fmt.Printf("  %-22s %8.1f %8.1f %9.1f %9.1f %14.1fx %10.0f%% %15.0f%%\n", row.name, c, q, r, f, c/q, 100*c/r, 100*c/f)
		fmt.Printf("  %-22s target carrel/qemu-ga >= 10x: %s; carrel/raw >= 50%%: %s; carrel/raw+file >= 60%%: %s\n", "", verdict(c/q >= 10), verdict(c/r >= 0.5), verdict(c/f >= 0.6))
	}
	printThreads := func(dir string, c, r *threadWatch) {
		if err := cmp.Or(c.err, r.err); err != nil {
			fmt.Printf("  %s: QEMU's threads not read: %v\n", dir, err)
			return
		}
		cm, rm := c.median(), r.median()
		fmt.Printf("  %-6s carrel    main loop %v\n  %-6s           vCPU      %v\n", dir, cm.main, "", cm.vcpus)
		fmt.Printf("  %-6s raw+file  main loop %v\n  %-6s           vCPU      %v\n", "", rm.main, "", rm.vcpus)
	}
	fmt.Printf("  QEMU's threads during each transfer, median of the rounds (raw+file's include starting its dd):\n")
	printThreads("write", &carThreads.write, &rawThreads.write)
	printThreads("read", &carThreads.read, &rawThreads.read)
	fmt.Printf("  (carrel: supervisor/client Upload/Download through carreld; qemu-ga: guest-file-open/write/read/close;\n" +
		"   raw: the hot-added port into / out of `dd` in the guest, timed from when the guest has the port open, so without start-up;\n" +
		"   raw+file: the same, with dd writing (conv=fsync) or reading a file in the guest's /tmp, where carrel and qemu-ga write theirs)\n")
	return nil
}

// guestCmd is a guest command running in the background.
type guestCmd struct {
	done   chan struct{}
	err    error
	stderr string // once done
}

func (b *qgaBench) background(ctx context.Context, script string, args ...string) *guestCmd {
	g := &guestCmd{done: make(chan struct{})}
	go func() {
		_, g.stderr, g.err = b.root2(ctx, script, args...)
		close(g.done)
	}()
	return g
}

func (g *guestCmd) wait() error {
	<-g.done
	return g.err
}

// rawToGuest times data through the raw port to a guest shell that signals
// when it has the port open and again when it has put len(data) bytes into
// dst (/dev/null, or a file it then fsyncs).
func (b *qgaBench) rawToGuest(ctx context.Context, data []byte, dst string) (float64, error) {
	conn, err := net.Dial("unix", b.rawSock)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Minute))
	// The same send buffer as carreld's end of the data port: the floor is
	// the port as carreld drives it, so the ratio is carrel's own cost.
	if err := conn.(*net.UnixConn).SetWriteBuffer(agentlink.SendBufferBytes); err != nil {
		return 0, err
	}
	// Each read of a port returns at most one 4 KiB buffer, so the reader's
	// syscalls per buffer set the pace: dd gathers full 1 MiB blocks before
	// each write to /dev/null, one syscall per buffer as carrel-agent does
	// (a 4 KiB read-and-write tool such as head makes two).
	const bs = 1 << 20
	if len(data)%bs != 0 {
		return 0, fmt.Errorf("size %d is not a multiple of %d", len(data), bs)
	}
	sync := ""
	if dst != "/dev/null" {
		sync = "conv=fsync"
	}
	g := b.background(ctx, `exec 3<>"$1"; echo r >&3; dd of="$4" bs="$2" count="$3" iflag=fullblock $5 <&3 && echo d >&3`,
		b.rawDev, strconv.Itoa(bs), strconv.Itoa(len(data)/bs), dst, sync)
	r := bufio.NewReader(conn)
	if err := expectLine(r, "r", g); err != nil {
		return 0, err
	}
	start := time.Now()
	if _, err := conn.Write(data); err != nil {
		return 0, errors.Join(err, g.wait())
	}
	if err := expectLine(r, "d", g); err != nil {
		return 0, err
	}
	el := time.Since(start)
	if err := g.wait(); err != nil {
		return 0, err
	}
	// dd's own count: every byte arrived, in full blocks.
	if want := fmt.Sprintf("%d+0 records in", len(data)/bs); !strings.Contains(g.stderr, want) {
		return 0, fmt.Errorf("guest dd did not read %d bytes in full blocks: %q", len(data), g.stderr)
	}
	return mibps(int64(len(data)), el), nil
}

// rawFromGuest times size bytes from src in the guest (/dev/zero or a
// file) through the raw port, from the first byte to the last.
func (b *qgaBench) rawFromGuest(ctx context.Context, size int64, src string) (float64, error) {
	conn, err := net.Dial("unix", b.rawSock)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Minute))
	// dd writes 32 KiB at a time, the most the kernel takes per write to a
	// port; a shell tool's 4 KiB writes would understate the port.
	const bs = 32 << 10
	if size%bs != 0 {
		return 0, fmt.Errorf("size %d is not a multiple of %d", size, bs)
	}
	g := b.background(ctx, `exec 3<>"$1"; dd if="$4" bs="$2" count="$3" status=none >&3`, b.rawDev, strconv.Itoa(bs), strconv.FormatInt(size/bs, 10), src)
	var first [1]byte
	if _, err := io.ReadFull(conn, first[:]); err != nil {
		return 0, errors.Join(err, g.wait())
	}
	start := time.Now()
	n, err := io.CopyN(io.Discard, conn, size-1)
	el := time.Since(start)
	if err != nil {
		return 0, fmt.Errorf("got %d of %d bytes: %w", n+1, size, errors.Join(err, g.wait()))
	}
	return mibps(size-1, el), g.wait()
}

// expectLine reads one line and checks it, failing early if the guest
// command fails first.
func expectLine(r *bufio.Reader, want string, g *guestCmd) error {
	got := make(chan error, 1)
	go func() {
		line, err := r.ReadString('\n')
		if err == nil && strings.TrimSpace(line) != want {
			err = fmt.Errorf("guest said %q, want %q", line, want)
		}
		got <- err
	}()
	select {
	case err := <-got:
		return err
	case <-g.done:
		if g.err != nil {
			return g.err
		}
	}
	// The command ended well: its line is on its way or lost.
	select {
	case err := <-got:
		return err
	case <-time.After(10 * time.Second):
		return fmt.Errorf("guest command ended without saying %q", want)
	}
}

// buildMinClient builds tests/bench/minclient as make build builds the CLI
// (static, stripped) into a directory of its own, and returns its path.
func buildMinClient() (string, error) {
	dir, err := os.MkdirTemp("", "carrel-minclient-")
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "minclient")
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags", "-s -w", "-o", bin, "./tests/bench/minclient")
	cmd.Dir = harness.RepoRoot()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return "", fmt.Errorf("build minclient: %v\n%s", err, out)
	}
	return bin, nil
}

// runMinClient runs argv in vm through the minimal client, the way the
// harness runs the CLI: a new process, its output captured.
func runMinClient(ctx context.Context, bin, socket, vm string, argv ...string) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, append([]string{vm}, argv...)...)
	cmd.Env = append(os.Environ(), "CARREL_SOCKET="+socket)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("minclient: %v: %s", err, errb.String())
	}
	return nil
}
