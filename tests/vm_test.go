package tests

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"os"
	osexec "os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/carrel-os/carrel/tests/harness"
)

type vmJSON struct {
	Name        string `json:"name"`
	State       string `json:"state"`
	AgentState  string `json:"agentState"`
	ImageDigest string `json:"imageDigest"`
	Pid         int    `json:"pid"`
	Cpus        int    `json:"cpus"`
	MemoryBytes string `json:"memoryBytes"`
	LastError   string `json:"lastError"`
}

func list(t *testing.T, d *harness.Daemon) []vmJSON {
	t.Helper()
	var out struct {
		Vms []vmJSON `json:"vms"`
	}
	if err := json.Unmarshal([]byte(d.Must("vm", "ls", "--output", "json")), &out); err != nil {
		t.Fatal(err)
	}
	return out.Vms
}

func vmNamed(t *testing.T, d *harness.Daemon, name string) (vmJSON, bool) {
	for _, v := range list(t, d) {
		if v.Name == name {
			return v, true
		}
	}
	return vmJSON{}, false
}

// TestVMEndToEnd walks the operator's flow from the README on one VM:
// build, create, list, exec (streams, exit codes, megabytes of output),
// carreld crash and re-adoption, stop, start, rm.
func TestVMEndToEnd(t *testing.T) {
	d := harness.New(t)
	d.Start()
	digest := d.BuildImage()

	start := time.Now()
	d.Must("vm", "create", "demo", "--image", "dev", "--memory", "512M", "--cpus", "1")
	t.Logf("create to agent-ready took %s", time.Since(start).Round(time.Millisecond))
	v, ok := vmNamed(t, d, "demo")
	if !ok || v.State != "VM_STATE_RUNNING" || v.AgentState != "AGENT_STATE_READY" || v.ImageDigest != digest || v.Pid == 0 {
		t.Fatalf("after create: %+v", v)
	}
	if v.MemoryBytes != "536870912" || v.Cpus != 1 {
		t.Errorf("resources: %+v", v)
	}
	if pids := harness.QEMUPids(d.State); len(pids) != 1 || pids[0] != v.Pid {
		t.Fatalf("qemu processes %v, want just %d", pids, v.Pid)
	}
	// The VM records the image digest it booted.
	rec, err := os.ReadFile(filepath.Join(d.State, "vms", "demo", "vm.json"))
	if err != nil || !strings.Contains(string(rec), digest) {
		t.Errorf("vm record lacks the image digest: %s %v", rec, err)
	}

	t.Run("exec", func(t *testing.T) {
		if out := d.Must("exec", "demo", "--", "uname", "-a"); !strings.HasPrefix(out, "Linux carrel ") {
			t.Errorf("uname -a = %q", out)
		}
		checkGuestCPU(t, d, "demo")
		r := d.Carrel("exec", "demo", "--", "sh", "-c", "echo out; echo err >&2; exit 3")
		if r.Code != 3 || r.Stdout != "out\n" || r.Stderr != "err\n" {
			t.Errorf("exit/streams: %+v", r)
		}
		r = d.Carrel("exec", "demo", "--env", "GREETING=hi there", "--cwd", "/tmp", "--", "sh", "-c", `echo "$GREETING from $(pwd)"`)
		if r.Code != 0 || r.Stdout != "hi there from /tmp\n" {
			t.Errorf("env/cwd: %+v", r)
		}
		r = d.Carrel("exec", "demo", "--", "sh", "-c", "kill -9 $$")
		if r.Code != 137 {
			t.Errorf("killed by signal: exit %d, want 137", r.Code)
		}
		r = d.Carrel("exec", "demo", "--", "no-such-command")
		if r.Code == 0 || !strings.Contains(r.Stderr, "no-such-command") {
			t.Errorf("missing command: %+v", r)
		}
		r = d.Carrel("exec", "nope", "--", "true")
		if r.Code != 125 || !strings.Contains(r.Stderr, "nope") {
			t.Errorf("exec in a missing vm: %+v", r)
		}
		// Without -i a command reads an empty stdin (and runs on the link's
		// shared Commands stream); with -i it reads the CLI's.
		r = d.CarrelTimeout(time.Minute, "exec", "demo", "--", "sh", "-c", "cat; echo read $?")
		if r.Code != 0 || r.Stdout != "read 0\n" {
			t.Errorf("exec without -i: %+v, want an empty stdin", r)
		}
		// A young command's output is held a moment to go out with what
		// follows it; each chunk keeps its own bytes.
		r = d.CarrelTimeout(time.Minute, "exec", "demo", "--", "sh", "-c", "for i in 1 2 3 4 5 6 7 8; do printf $i$i$i$i; done; echo e >&2")
		if r.Code != 0 || r.Stdout != "11112222333344445555666677778888" || r.Stderr != "e\n" {
			t.Errorf("output in chunks: %+v, want 1111 to 8888, and e", r)
		}
		r = d.CarrelStdin("piped\n", "exec", "-i", "demo", "--", "cat")
		if r.Code != 0 || r.Stdout != "piped\n" {
			t.Errorf("exec -i: %+v", r)
		}
		// ^C to the CLI is the command's.
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		cmd := osexec.CommandContext(ctx, filepath.Join(d.Bin, "carrel"), "exec", "demo", "--",
			"sh", "-c", "trap 'echo got INT; exit 7' INT; echo ready; while :; do sleep 0.1; done")
		cmd.Env = append(os.Environ(), "CARREL_SOCKET="+d.Socket)
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		line, _ := bufio.NewReader(stdout).ReadString('\n')
		if line != "ready\n" {
			t.Fatalf("the command did not start: %q", line)
		}
		cmd.Process.Signal(syscall.SIGINT)
		rest, _ := io.ReadAll(stdout)
		if err := cmd.Wait(); cmd.ProcessState.ExitCode() != 7 || string(rest) != "got INT\n" {
			t.Errorf("after ^C: exit %d (%v), output %q; want the command's trap to run", cmd.ProcessState.ExitCode(), err, rest)
		}
	})

	t.Run("megabytes of output", func(t *testing.T) {
		const size = 24 << 20
		sum := d.Must("exec", "demo", "--", "sh", "-c", "head -c 25165824 /dev/urandom > /tmp/blob && sha256sum /tmp/blob")
		out := d.Must("exec", "demo", "--", "cat", "/tmp/blob")
		if len(out) != size {
			t.Fatalf("got %d bytes, want %d", len(out), size)
		}
		h := sha256.Sum256([]byte(out))
		if got := hex.EncodeToString(h[:]); !strings.HasPrefix(sum, got) {
			t.Errorf("sha256 of streamed output %s, guest says %s", got, sum)
		}
	})

	t.Run("carreld crash re-adopts the running vm", func(t *testing.T) {
		before, _ := vmNamed(t, d, "demo")
		d.Must("exec", "demo", "--", "sh", "-c", "echo survived > /workspace/marker")
		d.Kill()
		if pids := harness.QEMUPids(d.State); len(pids) != 1 || pids[0] != before.Pid {
			t.Fatalf("after carreld was killed: qemu processes %v, want %d still running", pids, before.Pid)
		}
		d.Start()
		after, ok := vmNamed(t, d, "demo")
		if !ok || after.State != "VM_STATE_RUNNING" || after.Pid != before.Pid {
			t.Fatalf("after restart: %+v (before %+v)", after, before)
		}
		// Same VM, same guest memory: the workspace file is still there.
		if out := d.Must("exec", "demo", "--", "cat", "/workspace/marker"); out != "survived\n" {
			t.Errorf("marker = %q", out)
		}
		if pids := harness.QEMUPids(d.State); len(pids) != 1 {
			t.Errorf("qemu processes after re-adoption: %v", pids)
		}
	})

	t.Run("carreld stopped by SIGTERM leaves the vm running", func(t *testing.T) {
		before, _ := vmNamed(t, d, "demo")
		d.Stop()
		if pids := harness.QEMUPids(d.State); len(pids) != 1 || pids[0] != before.Pid {
			t.Fatalf("after SIGTERM: qemu processes %v, want %d", pids, before.Pid)
		}
		d.Start()
		after, _ := vmNamed(t, d, "demo")
		if after.State != "VM_STATE_RUNNING" || after.Pid != before.Pid {
			t.Fatalf("after restart: %+v", after)
		}
		if out := d.Must("exec", "demo", "--", "cat", "/workspace/marker"); out != "survived\n" {
			t.Errorf("marker = %q", out)
		}
	})

	t.Run("stop start rm", func(t *testing.T) {
		v, _ := vmNamed(t, d, "demo")
		d.Must("vm", "stop", "demo")
		st, _ := vmNamed(t, d, "demo")
		if st.State != "VM_STATE_STOPPED" || st.Pid != 0 {
			t.Errorf("after stop: %+v", st)
		}
		if pids := harness.QEMUPids(d.State); len(pids) != 0 {
			t.Errorf("qemu still running after stop: %v (was %d)", pids, v.Pid)
		}
		if r := d.Carrel("exec", "demo", "--", "true"); r.Code != 125 || !strings.Contains(r.Stderr, "not running") {
			t.Errorf("exec in a stopped vm: %+v", r)
		}
		d.Must("vm", "start", "demo")
		if out := d.Must("exec", "demo", "--", "echo", "back"); out != "back\n" {
			t.Errorf("after restart: %q", out)
		}
		if r := d.Carrel("vm", "rm", "demo"); r.Code == 0 {
			t.Error("rm of a running vm succeeded without --force")
		}
		d.Must("vm", "stop", "demo")
		d.Must("vm", "rm", "demo")
		if _, ok := vmNamed(t, d, "demo"); ok {
			t.Error("vm still listed after rm")
		}
		if _, err := os.Stat(filepath.Join(d.State, "vms", "demo")); !os.IsNotExist(err) {
			t.Errorf("vm state left after rm: %v", err)
		}
	})
}

// TestCreateRejectsBadArguments checks that each bad create gives a clear
// error and creates nothing.
func TestCreateRejectsBadArguments(t *testing.T) {
	d := harness.New(t)
	d.Start()
	d.BuildImage()
	d.Must("vm", "create", "taken", "--memory", "256M")
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"vm", "create", "Bad_Name"}, "invalid vm name"},
		{[]string{"vm", "create", "../escape"}, "invalid vm name"},
		{[]string{"vm", "create", "taken"}, "already exists"},
		{[]string{"vm", "create", "x1", "--image", "nosuch"}, "unknown image"},
		{[]string{"vm", "create", "x2", "--image", "sha256:" + strings.Repeat("0", 64)}, "unknown image"},
		{[]string{"vm", "create", "x3", "--memory", "1M"}, "out of range"},
		{[]string{"vm", "create", "x4", "--memory", "lots"}, "invalid size"},
		{[]string{"vm", "create", "x5", "--cpus", "1000"}, "out of range"},
	}
	for _, c := range cases {
		r := d.Carrel(c.args...)
		if r.Code == 0 || !strings.Contains(r.Stderr, c.want) {
			t.Errorf("carrel %v: exit %d, stderr %q; want an error with %q", c.args, r.Code, r.Stderr, c.want)
		}
	}
	vms := list(t, d)
	if len(vms) != 1 || vms[0].Name != "taken" {
		t.Errorf("vms after bad creates: %+v", vms)
	}
	ents, _ := os.ReadDir(filepath.Join(d.State, "vms"))
	if len(ents) != 1 {
		t.Errorf("state dirs after bad creates: %v", ents)
	}
	if pids := harness.QEMUPids(d.State); len(pids) != 1 {
		t.Errorf("qemu processes: %v, want 1", pids)
	}
	d.Must("vm", "rm", "--force", "taken")
}

// TestBootFailures checks that a guest that panics, or never becomes
// ready, fails create within a bounded time with the console's last lines,
// leaving no QEMU and no state behind.
func TestBootFailures(t *testing.T) {
	d := harness.New(t, "--boot-timeout", "20s")
	d.Start()
	d.BuildImage()
	st := openStore(t, d)

	cases := []struct {
		name, tag string
		make      func() string // returns the digest of a broken image
		want      string
	}{
		{"initrd is garbage", "garbage", func() string { return brokenImage(t, st, "garbage", "", []byte("not a cpio archive")) }, "Kernel panic"},
		{"init never serves", "hang", func() string {
			// /bin/cat as the verified root's init waits on the console
			// forever: the kernel and the root are fine, the agent hands
			// over to it and never answers.
			return brokenImage(t, st, "hang", devCmdline(t, st)+" init=/bin/cat", nil)
		}, "did not become ready"},
		{"root hash is wrong", "badhash", func() string { return wrongRootHash(t, st, "badhash") }, "failed verification"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			c.make()
			start := time.Now()
			r := d.Carrel("vm", "create", "broken", "--image", c.tag)
			took := time.Since(start)
			if r.Code == 0 {
				t.Fatal("create succeeded")
			}
			if !strings.Contains(r.Stderr, c.want) || !strings.Contains(r.Stderr, "serial console") {
				t.Errorf("error lacks %q or the console tail:\n%s", c.want, r.Stderr)
			}
			if took > 60*time.Second {
				t.Errorf("create took %s to fail", took)
			}
			if pids := harness.QEMUPids(d.State); len(pids) != 0 {
				t.Errorf("qemu left running: %v", pids)
			}
			if _, ok := vmNamed(t, d, "broken"); ok {
				t.Error("broken vm is listed")
			}
			if _, err := os.Stat(filepath.Join(d.State, "vms", "broken")); !os.IsNotExist(err) {
				t.Errorf("state left behind: %v", err)
			}
		})
	}
}

func TestQEMUFailsToStart(t *testing.T) {
	// A bad binary stands in for a QEMU that cannot start at all; libvirt
	// runs its own.
	harness.RequireDriver(t, "qemu")
	d := harness.New(t, "--qemu", "/bin/false")
	d.Start()
	d.BuildImage()
	r := d.Carrel("vm", "create", "demo")
	if r.Code == 0 || !strings.Contains(r.Stderr, "qemu") {
		t.Errorf("create with a failing qemu: %+v", r)
	}
	if _, err := os.Stat(filepath.Join(d.State, "vms", "demo")); !os.IsNotExist(err) {
		t.Errorf("state left behind: %v", err)
	}
}
