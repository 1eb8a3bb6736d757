// Command bench measures carrel against its baselines (make bench):
//
//   - boot to agent-ready (-boot): `carrel vm create` through the qemu
//     driver and through the libvirt driver (a second carreld; -boot-libvirt,
//     where libvirtd can be had) against bare qemu-system-x86_64 booting the
//     same kernel and initrd on the same machine type to the agent's ready
//     marker on the serial port, alternating (see boot.go);
//   - warm exec (-warm-exec): the round trip of `carrel exec VM -- true`,
//     CLI process included, p50 and p99;
//   - against qemu-guest-agent (-qga-exec, -qga-files), in one VM booted by
//     carreld from the qemu-guest-agent variant of the dev image, with
//     qemu-ga and a bare port hot-added on carrel's own virtio-serial
//     controller (see qga.go): the round trip of `true` (carrel's Go
//     client against guest-exec plus guest-exec-status polling; the CLI
//     against it and against a minimal Go client process, minclient; with
//     the guest's vCPU time per run of each, which under emulation is most
//     of the round trip and far steadier than its latency), and file
//     write and read throughput (Upload/Download against
//     guest-file-write/-read, and against the raw port), with what QEMU's
//     main loop and vCPU threads did meanwhile (see threads.go);
//   - policy decisions (-policy): the default bundle's prepared queries
//     against compiling the bundle on every call (see policy.go); needs
//     no VM;
//   - the audit log (-audit): durable append throughput and latency with
//     group commit against an fdatasync per record, and verification
//     speed (see audit.go); needs no VM;
//   - host memory (-overhead): QEMU's PSS per VM less its guest RAM, and
//     carreld's RSS, with 10 VMs running (see overhead.go);
//   - egress (-egress): a download through the guest's proxy and carreld's
//     egress proxy against the same download directly on the host, and
//     connection setup both ways (see egress.go);
//   - the agent image (-image): `carrel image build agent` cold, warm and
//     cached, its size, boot to agent-ready against the dev image and bare
//     QEMU with the same disks, and the first python3 after boot (see
//     image.go);
//   - dm-verity (-verity): a file read through the verified root against
//     the same erofs unverified, in one VM (see image.go).
//
// Every section above is on by default; each prints medians and ratios.
// Three more are off unless asked for, and asking for any of them turns
// the others off unless they are named too (make bench-load, make soak):
//
//   - load (-load): -load-vms VMs with -load-clients clients each, for
//     -load-duration, each client looping over exec, a 1 MiB cp each way,
//     stat and list; throughput, p50/p99 per operation, carreld's RSS,
//     goroutines and fds before and after, QEMU's PSS, audit records per
//     second, with pass/fail checks (see load.go);
//   - fault injection (-fault): the load, with one VM's QEMU stopped
//     (SIGSTOP) for -fault-stop midway (see load.go);
//   - soak (-soak): the load at a lower rate for -soak-duration, with
//     carreld killed and restarted every -soak-restart (see soak.go).
//
// A failed check of these three makes the program exit 1.
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/image/store"
	"github.com/carrel-os/carrel/image/workspace"
	"github.com/carrel-os/carrel/supervisor/accel"
	"github.com/carrel-os/carrel/supervisor/client"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
	"github.com/carrel-os/carrel/tests/harness"
	"github.com/carrel-os/carrel/tests/qga"
)

// tb lets the harness run outside `go test`. Fatal runs the cleanups (which
// stop carreld and kill its VMs) before exiting.
type tb struct {
	cleanups []func()
	failed   bool
}

func (*tb) Helper()                     {}
func (t *tb) Fatal(args ...any)         { t.fail(fmt.Sprint(args...)) }
func (t *tb) Fatalf(f string, a ...any) { t.fail(fmt.Sprintf(f, a...)) }
func (*tb) Logf(f string, args ...any)  { log.Printf(f, args...) }
func (t *tb) Skip(args ...any)          { t.fail("cannot run: " + fmt.Sprint(args...)) }
func (t *tb) Cleanup(f func())          { t.cleanups = append(t.cleanups, f) }
func (t *tb) Failed() bool              { return t.failed }
func (t *tb) fail(msg string) {
	log.Print(msg)
	t.failed = true
	t.cleanup()
	os.Exit(1)
}
func (t *tb) cleanup() {
	for len(t.cleanups) > 0 { // a cleanup that fails must not rerun the rest
		f := t.cleanups[len(t.cleanups)-1]
		t.cleanups = t.cleanups[:len(t.cleanups)-1]
		f()
	}
}

func main() {
	doBoot := flag.Bool("boot", true, "boot to agent-ready: carrel's qemu and libvirt drivers against bare QEMU")
	bootLibvirt := flag.Bool("boot-libvirt", true, "with -boot, boot through the libvirt driver too (a second carreld; starts libvirtd if need be)")
	doWarm := flag.Bool("warm-exec", true, "warm `carrel exec -- true` through the CLI")
	doQGAExec := flag.Bool("qga-exec", true, "exec round trip: carrel against qemu-guest-agent")
	doQGAFiles := flag.Bool("qga-files", true, "file throughput: carrel against qemu-guest-agent and the raw port")
	rounds := flag.Int("rounds", 7, "boots of each kind, alternating")
	execs := flag.Int("execs", 100, "warm exec round trips (CLI), and of each kind against qemu-ga")
	machine := flag.String("machine", "q35", "QEMU machine type for every VM: microvm or q35 (carreld's default under TCG is q35)")
	sizeMiB := flag.Int64("size", 256, "file size for the throughput comparison, MiB (whole MiB)")
	fileRounds := flag.Int("file-rounds", 3, "rounds of the throughput comparison (each moves -size both ways on every side)")
	chunkKiB := flag.Int("qga-chunk", 4096, "KiB per guest-file-read/-write (qemu-ga caps a read at 48 MiB)")
	qgaMemory := flag.String("qga-memory", "1G", "memory of the comparison VM; its /tmp (tmpfs, half of memory) must hold -size")
	doPolicy := flag.Bool("policy", true, "policy decision latency: prepared queries against compiling per call")
	doAudit := flag.Bool("audit", true, "audit log: durable append throughput and latency against fsync per record, verification speed")
	doEgress := flag.Bool("egress", true, "egress: download through the tunnel against directly on the host, connection setup")
	doOverhead := flag.Bool("overhead", true, "host memory per VM (QEMU's PSS less guest RAM) and carreld's RSS with -overhead-vms VMs running")
	overheadVMs := flag.Int("overhead-vms", 10, "VMs running for -overhead")
	egressMiB := flag.Int64("egress-size", 256, "egress download size, MiB")
	egressRounds := flag.Int("egress-rounds", 3, "rounds of the egress download, each way, alternating")
	doImage := flag.Bool("image", true, "the agent image: build time (cold, warm, cached) and size, boot to agent-ready against the dev image and bare QEMU, first python3 after boot")
	doVerity := flag.Bool("verity", true, "dm-verity's cost: a file read from the verified root against the same erofs unverified, in one VM")
	verityMiB := flag.Int64("verity-size", 256, "file size for -verity, MiB")
	doSnapshot := flag.Bool("snapshot", true, "snapshots: restore to agent-ready against a cold boot, fork, snapshot time and size, host memory of forks against cold boots")
	snapForks := flag.Int("snapshot-forks", 5, "forks (and cold boots) -snapshot measures host memory with")
	snapLibvirt := flag.Bool("snapshot-libvirt", true, "with -snapshot, measure through the libvirt driver too (a second carreld; starts libvirtd if need be)")
	doAgents := flag.Bool("agents", true, "agent doors: the e2b SDK's commands.run through the e2b API against carrel's Go client, MCP's exec against the CLI's")
	doFleet := flag.Bool("fleet", true, "the fleet at scale: a real control plane places -fleet-vms AgentVMs on -fleet-nodes simulated hosts (kwok) of -fleet-gpus GPUs and one real carreld; placement rate, create→Running, memory, and -fleet-lost hosts lost (needs make fleet-tools)")
	var fleetCfg fleetConfig
	flag.IntVar(&fleetCfg.nodes, "fleet-nodes", 1000, "simulated hosts for -fleet")
	flag.IntVar(&fleetCfg.gpus, "fleet-gpus", 8, "GPUs of each simulated host")
	flag.IntVar(&fleetCfg.vms, "fleet-vms", 5000, "AgentVMs for -fleet (50000 for the long run)")
	flag.IntVar(&fleetCfg.lost, "fleet-lost", 50, "simulated hosts -fleet loses (their Leases stopped) once every AgentVM runs")
	flag.DurationVar(&fleetCfg.lossTimeout, "fleet-loss-timeout", 40*time.Second, "carrel-controller's --node-loss-timeout for -fleet")
	flag.DurationVar(&fleetCfg.limit, "fleet-limit", 20*time.Minute, "longest -fleet waits for every AgentVM to run")
	doLoad := flag.Bool("load", false, "load: -load-vms VMs x -load-clients clients for -load-duration, with pass/fail checks; alone, turns the default sections off")
	doFault := flag.Bool("fault", false, "fault injection: the load (its flags), with one VM's QEMU stopped for -fault-stop midway")
	doSoak := flag.Bool("soak", false, "soak: a lower-rate load for -soak-duration with carreld killed and restarted every -soak-restart")
	load := loadConfig{opTimeout: 2 * time.Minute}
	flag.IntVar(&load.vms, "load-vms", 10, "VMs for -load and -fault")
	flag.IntVar(&load.clients, "load-clients", 8, "concurrent clients per VM for -load and -fault")
	flag.DurationVar(&load.duration, "load-duration", 5*time.Minute, "how long -load and -fault load the VMs")
	flag.StringVar(&load.memory, "load-memory", "256M", "memory of each VM of -load, -fault and -soak")
	flag.DurationVar(&load.settle, "load-settle", 3*time.Minute, "longest wait after the load for carreld's RSS, goroutines and fds to come back")
	flag.DurationVar(&load.warmup, "load-warmup", 30*time.Second, "the same load run first, before the baseline carreld's RSS, goroutines and fds are held to; 0 for none")
	flag.DurationVar(&load.faultStop, "fault-stop", 30*time.Second, "how long -fault keeps the VM's QEMU stopped")
	soak := loadConfig{opTimeout: 2 * time.Minute}
	flag.IntVar(&soak.vms, "soak-vms", 4, "VMs for -soak")
	flag.IntVar(&soak.clients, "soak-clients", 2, "clients per VM for -soak")
	flag.DurationVar(&soak.pause, "soak-pause", time.Second, "pause between a -soak client's rounds (its lower rate)")
	flag.DurationVar(&soak.duration, "soak-duration", time.Hour, "how long -soak runs")
	soakEvery := flag.Duration("soak-restart", 10*time.Minute, "how often -soak kills carreld (SIGKILL) and starts it again")
	flag.Parse()
	soak.memory, soak.settle, soak.warmup = load.memory, load.settle, load.warmup
	load.fault = *doFault
	if *doLoad || *doFault || *doSoak {
		// These run alone unless other sections are named as well.
		named := map[string]bool{}
		flag.Visit(func(f *flag.Flag) { named[f.Name] = true })
		for name, on := range map[string]*bool{"boot": doBoot, "warm-exec": doWarm, "qga-exec": doQGAExec, "qga-files": doQGAFiles,
			"policy": doPolicy, "audit": doAudit, "egress": doEgress, "overhead": doOverhead, "image": doImage, "verity": doVerity,
			"snapshot": doSnapshot, "agents": doAgents, "fleet": doFleet} {
			if !named[name] {
				*on = false
			}
		}
	}
	log.SetFlags(0)
	switch {
	case *rounds < 1 || *execs < 1 || *fileRounds < 1:
		log.Fatal("-rounds, -execs and -file-rounds must be at least 1")
	case *sizeMiB < 1 || *egressMiB < 1:
		log.Fatal("-size and -egress-size must be at least 1 (MiB)")
	case *egressRounds < 1:
		log.Fatal("-egress-rounds must be at least 1")
	case *chunkKiB < 1 || *chunkKiB<<10 > qga.MaxReadCount:
		log.Fatalf("-qga-chunk must be 1..%d (KiB)", qga.MaxReadCount>>10)
	case load.vms < 1 || load.clients < 1 || soak.vms < 1 || soak.clients < 1:
		log.Fatal("-load-vms, -load-clients, -soak-vms and -soak-clients must be at least 1")
	case *doFault && load.vms < 2:
		log.Fatal("-fault needs at least 2 VMs (-load-vms): one stopped, the others loaded")
	case *doSoak && *soakEvery >= soak.duration:
		log.Fatal("-soak-restart must be shorter than -soak-duration")
	}

	if *doPolicy {
		if err := benchPolicy(); err != nil {
			log.Fatalf("policy benchmark: %v", err)
		}
	}
	if *doAudit {
		if err := benchAudit(); err != nil {
			log.Fatalf("audit benchmark: %v", err)
		}
	}
	loadMode := *doLoad || *doFault || *doSoak
	if !*doBoot && !*doWarm && !*doQGAExec && !*doQGAFiles && !*doEgress && !*doOverhead && !*doImage && !*doVerity && !*doSnapshot && !*doAgents && !loadMode && !*doFleet {
		return // no VM needed
	}

	// The benchmarks pick each carreld's driver themselves.
	os.Unsetenv(harness.DriverEnv)
	t := &tb{}
	defer t.cleanup()
	if *doFleet {
		ft := &tb{}
		benchFleet(ft, fleetCfg)
		ft.cleanup()
	}
	hostsDir, err := os.MkdirTemp("", "carrel-bench-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(hostsDir)
	hosts, err := egressHosts(hostsDir)
	if err != nil {
		log.Fatal(err)
	}
	args := []string{"--driver", "qemu", "--machine", *machine, "--egress-hosts", hosts}
	var debugSock string
	if loadMode {
		// The load's goroutine counts come from carreld's profiles.
		debugSock = filepath.Join(hostsDir, "debug.sock")
		args = append(args, "--debug-socket", debugSock)
	}
	d := harness.New(t, args...)
	d.Start()
	digest := d.BuildImage()
	st, err := store.Open(filepath.Join(d.State, "images"))
	if err != nil {
		t.Fatal(err)
	}
	img, err := st.Resolve("dev")
	if err != nil {
		t.Fatal(err)
	}
	acc := accelOf(d)
	fmt.Printf("carrel benchmarks: machine %s, 1 vCPU, accelerator %s, guest CPU %s, %d host CPUs\n", *machine, acc, accel.QEMUCPU(acc), runtime.NumCPU())

	if *doBoot {
		var lv *harness.Daemon
		if *bootLibvirt {
			var why string
			if lv, why = libvirtDaemon(t, digest); lv == nil {
				fmt.Printf("\nboot through libvirt: left out, %s\n", why)
			}
		}
		benchBoot(t, d, lv, img, *machine, *rounds)
		if lv != nil {
			lv.Stop()
		}
	}
	if *doVerity {
		benchVerity(t, img, *verityMiB, *fileRounds)
	}
	if *doImage {
		agent := benchImageBuild(t, d)
		benchAgentBoot(t, d, agent, *machine, *rounds)
	}
	if *doWarm {
		benchCLIStart(t, *execs)
		benchWarmExec(d, *execs)
	}
	if *doOverhead {
		benchOverhead(t, d, *overheadVMs)
	}
	if *doSnapshot {
		benchSnapshots(t, d, "qemu", *rounds, max(*snapForks, 2))
		if *snapLibvirt {
			if lv, why := libvirtDaemon(t, digest); lv == nil {
				fmt.Printf("\nsnapshots through libvirt: left out, %s\n", why)
			} else {
				benchSnapshots(t, lv, "libvirt", *rounds, max(*snapForks, 2))
				lv.Stop()
			}
		}
	}
	if *doAgents {
		benchAgents(t, *execs)
	}
	if *doEgress {
		benchEgress(t, d, *egressMiB<<20, *egressRounds)
	}
	if *doQGAExec || *doQGAFiles {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Hour)
		defer cancel()
		c := client.New(d.Socket)
		b, err := setupQGA(ctx, d, c, *qgaMemory)
		if b != nil {
			t.Cleanup(b.close)
		}
		if err != nil {
			t.Fatalf("qemu-ga comparison: %v", err)
		}
		fmt.Printf("\nagainst qemu-guest-agent %s: one VM from the variant image (%s, 1 vCPU), carrel and qemu-ga on ports of the same virtio-serial controller\n",
			b.gaVer, *qgaMemory)
		if *doQGAExec {
			if err := b.benchExec(ctx, *execs); err != nil {
				t.Fatalf("exec comparison: %v", err)
			}
		}
		if *doQGAFiles {
			if err := b.benchFiles(ctx, *sizeMiB<<20, *fileRounds, *chunkKiB<<10); err != nil {
				t.Fatalf("file comparison: %v", err)
			}
		}
		d.Must("vm", "rm", "--force", b.vm)
	}
	passed := true
	if *doLoad || *doFault {
		passed = benchLoad(t, d, debugSock, load) && passed
	}
	if *doSoak {
		passed = benchSoak(t, d, debugSock, soak, *soakEvery) && passed
	}
	if !passed {
		t.cleanup()
		os.Exit(1)
	}
}

// accelOf reports the accelerator carreld's VMs get.
func accelOf(d *harness.Daemon) string {
	resp, err := client.New(d.Socket).System.GetInfo(context.Background(), connect.NewRequest(&apiv1.GetInfoRequest{}))
	if err != nil {
		return "unknown accelerator"
	}
	return resp.Msg.Accelerator
}

// benchCLIStart measures the CLI's start alone (`carrel --version`, which
// reaches no daemon) against a static hello-world Go binary, interleaved:
// what carrel's size and package initialisation cost every command.
func benchCLIStart(t *tb, runs int) {
	dir, err := os.MkdirTemp("", "carrel-hello-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	src := filepath.Join(dir, "hello.go")
	if err := os.WriteFile(src, []byte("package main\n\nimport \"os\"\n\nfunc main() { os.Stdout.WriteString(\"hello\\n\") }\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	hello := filepath.Join(dir, "hello")
	build := exec.Command("go", "build", "-trimpath", "-ldflags", "-s -w", "-o", hello, src)
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build hello: %v\n%s", err, out)
	}
	carrel := filepath.Join(harness.Bins(t), "carrel")
	var cli, floor []time.Duration
	run := func(lat *[]time.Duration, name string, args ...string) {
		start := time.Now()
		if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", name, err, out)
		}
		*lat = append(*lat, time.Since(start))
	}
	for i := 0; i < runs; i++ {
		run(&cli, carrel, "--version")
		run(&floor, hello)
	}
	r := func(d time.Duration) time.Duration { return d.Round(10 * time.Microsecond) }
	fmt.Printf("\nCLI start alone, %d runs interleaved: `carrel --version` p50 %v p99 %v; a static hello-world Go binary p50 %v p99 %v; carrel adds %v at p50\n",
		runs, r(percentile(cli, 50)), r(percentile(cli, 99)), r(percentile(floor, 50)), r(percentile(floor, 99)), r(percentile(cli, 50)-percentile(floor, 50)))
}

func benchWarmExec(d *harness.Daemon, execs int) {
	d.Must("vm", "create", "warm", "--memory", "512M", "--cpus", "1")
	d.Must("exec", "warm", "--", "true") // first call sets up the stream
	var lat []time.Duration
	for i := 0; i < execs; i++ {
		start := time.Now()
		d.Must("exec", "warm", "--", "true")
		lat = append(lat, time.Since(start))
	}
	fmt.Printf("\nwarm exec `carrel exec warm -- true` (CLI process included), %d runs: p50 %v, p99 %v\n",
		execs, percentile(lat, 50).Round(10*time.Microsecond), percentile(lat, 99).Round(10*time.Microsecond))
	d.Must("vm", "rm", "--force", "warm")
}

// bareBoot boots the image with plain QEMU and bareArgs's devices and
// times the start of QEMU to the agent's ready marker on the serial
// console.
func bareBoot(machine string, img *store.Resolved, memMiB int) (time.Duration, error) {
	dir, err := os.MkdirTemp("/tmp", "bare-")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(dir)
	args, _, err := bareArgs(machine, img, memMiB, dir)
	if err != nil {
		return 0, err
	}
	cmd := exec.Command("qemu-system-x86_64", args...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		return 0, err
	}
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if strings.Contains(sc.Text(), protocol.ReadyMarker) {
			return time.Since(start), nil
		}
	}
	return 0, fmt.Errorf("bare qemu exited before the ready marker: %v", sc.Err())
}

// bareArgs is the QEMU command line for img with the same devices carreld
// gives a VM of memMiB: the verified root's two read-only disks, the
// writable layer's disk and the workspace disk (each over the image's
// template, made in dir), the console on stdout, and the agent's
// virtio-serial port on the unix socket sock.
func bareArgs(machine string, img *store.Resolved, memMiB int, dir string) (args []string, sock string, err error) {
	mopt, serialDev, blockDev := "microvm,accel=tcg", "virtio-serial-device", "virtio-blk-device"
	cmdline := img.Manifest.Cmdline + " reboot=t"
	if machine == "q35" {
		mopt, serialDev, blockDev, cmdline = "q35,accel=tcg", "virtio-serial-pci", "virtio-blk-pci", img.Manifest.Cmdline
	}
	var disks []string
	drive := func(file, format, serial string, readOnly bool) {
		id := fmt.Sprintf("disk%d", len(disks)/4)
		opt := "if=none,id=" + id + ",format=" + format + ",file=" + file
		if readOnly {
			opt += ",readonly=on"
		} else {
			opt += ",discard=unmap"
		}
		disks = append(disks, "-drive", opt, "-device", blockDev+",drive="+id+",serial="+serial)
	}
	if img.SystemPath != "" {
		drive(img.SystemPath, "raw", protocol.SystemSerial, true)
		drive(img.SystemVerityPath, "raw", protocol.SystemVeritySerial, true)
		p := filepath.Join(dir, "state.qcow2")
		if err := workspace.Create(context.Background(), "qemu-img", p, img.WorkspacePath, 8<<30); err != nil {
			return nil, "", err
		}
		drive(p, "qcow2", protocol.StateSerial, false)
		cmdline += " " + protocol.StateArg + "=" + protocol.StateDisk
	}
	if img.WorkspacePath != "" {
		// Half the memory, as carreld sizes it.
		p := filepath.Join(dir, "workspace.qcow2")
		if err := workspace.Create(context.Background(), "qemu-img", p, img.WorkspacePath, uint64(memMiB/2)<<20); err != nil {
			return nil, "", err
		}
		drive(p, "qcow2", protocol.WorkspaceSerial, false)
		cmdline += " " + protocol.WorkspaceDiskArg
	}
	sock = filepath.Join(dir, "agent.sock")
	args = []string{
		"-machine", mopt, "-cpu", accel.QEMUCPU(accel.TCG), "-m", fmt.Sprintf("%dM", memMiB), "-smp", "1",
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-kernel", img.KernelPath, "-initrd", img.InitrdPath, "-append", cmdline,
		"-serial", "stdio",
		"-device", serialDev + ",id=vser0",
		"-chardev", "socket,id=agent,path=" + sock + ",server=on,wait=off",
		"-device", "virtserialport,bus=vser0.0,chardev=agent,name=" + protocol.SerialPortName,
	}
	return append(args, disks...), sock, nil
}
