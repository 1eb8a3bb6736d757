package tests

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/tests/harness"
)

// counter is a process that counts in its own memory, ten times a second,
// and shows its count in /tmp/count.
const counter = `i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.1; done`

func count(t *testing.T, d *harness.Daemon, vm string) int {
	t.Helper()
	out := strings.TrimSpace(d.Must("exec", vm, "--", "cat", "/tmp/count"))
	n, err := strconv.Atoi(out)
	if err != nil {
		t.Fatalf("count in %s: %q", vm, out)
	}
	return n
}

// TestPauseSnapshotRestoreFork: a paused VM keeps its memory and refuses
// calls; a process counting in memory goes on from the snapshot's count
// after a restore, and the disks are back too; a fork and its parent
// diverge (files, machine id, random bytes); damaged snapshots are refused
// with the VM unchanged; what a fork stands on cannot be deleted from under
// it; the audit log verifies.
func TestPauseSnapshotRestoreFork(t *testing.T) {
	d := harness.New(t)
	d.Start()
	d.BuildImage()
	d.Must("vm", "create", "snap", "--memory", "256M")
	d.Must("exec", "snap", "-d", "--", "sh", "-c", counter)
	deadline := time.Now().Add(30 * time.Second)
	for d.Carrel("exec", "snap", "--", "test", "-s", "/tmp/count").Code != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the counter never started")
		}
		time.Sleep(200 * time.Millisecond)
	}

	t.Run("pause", func(t *testing.T) {
		d.Must("vm", "pause", "snap")
		r := d.Carrel("exec", "snap", "--", "true")
		if r.Code == 0 || !strings.Contains(r.Stderr, "paused") || !strings.Contains(r.Stderr, "carrel vm resume snap") {
			t.Errorf("exec in a paused vm: %+v", r)
		}
		if out := d.Must("vm", "ls"); !strings.Contains(out, "running (paused)") {
			t.Errorf("vm ls of a paused vm:\n%s", out)
		}
		// A paused VM snapshots, again and again, and stays paused.
		for _, n := range []string{"p1", "p2"} {
			d.Must("vm", "snapshot", "snap", "--name", n)
		}
		if out := d.Must("vm", "ls"); !strings.Contains(out, "running (paused)") {
			t.Errorf("vm ls of a paused vm after its snapshots:\n%s", out)
		}
		for _, n := range []string{"p1", "p2"} {
			d.Must("vm", "snapshot", "rm", "snap", n)
		}
		time.Sleep(time.Second)
		d.Must("vm", "resume", "snap")
		before := count(t, d, "snap")
		time.Sleep(time.Second)
		if after := count(t, d, "snap"); after <= before {
			t.Errorf("the counter stands still after resume: %d then %d", before, after)
		}
	})

	var atSnapshot int
	t.Run("restore", func(t *testing.T) {
		atSnapshot = count(t, d, "snap")
		// A command running across the snapshot stalls for the pause and
		// goes on.
		across := make(chan harness.Result, 1)
		go func() { across <- d.Carrel("exec", "snap", "--", "sh", "-c", "sleep 2; echo done") }()
		time.Sleep(500 * time.Millisecond)
		start := time.Now()
		out := d.Must("vm", "snapshot", "snap", "--name", "s1", "--note", "before")
		t.Logf("snapshot took %s: %s", time.Since(start).Round(time.Millisecond), strings.TrimSpace(out))
		if r := <-across; r.Code != 0 || r.Stdout != "done\n" {
			t.Errorf("a command across the snapshot: %+v", r)
		}
		d.Must("exec", "snap", "--", "sh", "-c", "echo later > /workspace/later")
		// Long enough for the count to get well past where a restore, which
		// takes a second or two, could bring it.
		time.Sleep(10 * time.Second)
		later := count(t, d, "snap")
		// A command running across a restore fails, promptly: its VM is
		// gone.
		inflight := make(chan harness.Result, 1)
		go func() { inflight <- d.Carrel("exec", "snap", "--", "sleep", "120") }()
		time.Sleep(time.Second)
		start = time.Now()
		d.Must("vm", "restore", "snap", "s1")
		t.Logf("restore to agent-ready took %s", time.Since(start).Round(time.Millisecond))
		select {
		case r := <-inflight:
			if r.Code == 0 {
				t.Errorf("a command across a restore: %+v", r)
			}
		case <-time.After(30 * time.Second):
			t.Error("a command in flight hangs across a restore")
		}
		for _, l := range strings.Split(d.Logs(), "\n") {
			for _, step := range []string{"restored", "agent ready", "vm stopped", "healthy", "starting qemu", "sandbox set", "GoAway", "session", "answered"} {
				if strings.Contains(l, step) {
					t.Log(l[:min(len(l), 200)])
					break
				}
			}
		}
		got := count(t, d, "snap")
		// It goes on from where the snapshot was, not from 0, and not from
		// where it had got to since.
		if got < atSnapshot || got >= later {
			t.Errorf("after restore the count is %d; it was %d at the snapshot and %d before the restore", got, atSnapshot, later)
		}
		if r := d.Carrel("exec", "snap", "--", "test", "-e", "/workspace/later"); r.Code != 1 {
			t.Errorf("a file written after the snapshot is there after the restore: %+v", r)
		}
		time.Sleep(time.Second)
		if again := count(t, d, "snap"); again <= got {
			t.Errorf("the restored counter stands still: %d then %d", got, again)
		}
		var ls struct {
			Snapshots []struct {
				Name  string `json:"name"`
				Note  string `json:"note"`
				Bytes string `json:"bytes"`
			} `json:"snapshots"`
		}
		if err := json.Unmarshal([]byte(d.Must("vm", "snapshot", "ls", "snap", "--output", "json")), &ls); err != nil {
			t.Fatal(err)
		}
		if len(ls.Snapshots) != 1 || ls.Snapshots[0].Name != "s1" || ls.Snapshots[0].Note != "before" {
			t.Errorf("snapshot ls: %+v", ls)
		}
	})

	t.Run("fork", func(t *testing.T) {
		start := time.Now()
		d.Must("vm", "fork", "snap", "snapb")
		t.Logf("fork of a running vm to agent-ready took %s", time.Since(start).Round(time.Millisecond))
		d.Must("exec", "snap", "--", "sh", "-c", "echo a > /workspace/only-a")
		d.Must("exec", "snapb", "--", "sh", "-c", "echo b > /workspace/only-b")
		if r := d.Carrel("exec", "snapb", "--", "test", "-e", "/workspace/only-a"); r.Code != 1 {
			t.Errorf("the fork sees its parent's new file: %+v", r)
		}
		if r := d.Carrel("exec", "snap", "--", "test", "-e", "/workspace/only-b"); r.Code != 1 {
			t.Errorf("the parent sees its fork's new file: %+v", r)
		}
		// The fork has a machine id of its own (the image may have none).
		idA := strings.TrimSpace(d.Must("exec", "snap", "--", "sh", "-c", "cat /etc/machine-id 2>/dev/null || true"))
		idB := strings.TrimSpace(d.Must("exec", "snapb", "--", "cat", "/etc/machine-id"))
		if len(idB) != 32 || idA == idB {
			t.Errorf("machine ids: parent %q, fork %q", idA, idB)
		}
		for _, cmd := range [][]string{
			{"sh", "-c", "head -c 32 /dev/urandom | od -An -tx1"},
			{"cat", "/proc/sys/kernel/random/uuid"},
		} {
			a := d.Must(append([]string{"exec", "snap", "--"}, cmd...)...)
			b := d.Must(append([]string{"exec", "snapb", "--"}, cmd...)...)
			if a == b || strings.TrimSpace(a) == "" {
				t.Errorf("%v is the same in the fork and its parent: %q", cmd, a)
			}
		}
		// The fork's counter went on from the fork's instant, in the fork.
		if n := count(t, d, "snapb"); n < atSnapshot {
			t.Errorf("the fork's count %d is below the first snapshot's %d", n, atSnapshot)
		}
		var v struct {
			Session string `json:"session"`
			Origin  struct {
				VM       string `json:"vm"`
				Snapshot string `json:"snapshot"`
				Session  string `json:"session"`
				Fork     bool   `json:"fork"`
			} `json:"origin"`
		}
		if err := json.Unmarshal([]byte(d.Must("vm", "inspect", "snapb")), &v); err != nil {
			t.Fatal(err)
		}
		if v.Origin.VM != "snap" || v.Origin.Snapshot != "fork-snapb" || !v.Origin.Fork || v.Origin.Session == "" || v.Origin.Session == v.Session {
			t.Errorf("the fork's origin: %+v", v)
		}
		// What the fork stands on stays.
		if r := d.Carrel("vm", "snapshot", "rm", "snap", "fork-snapb"); r.Code == 0 || !strings.Contains(r.Stderr, "snapb") {
			t.Errorf("deleting the snapshot a vm was forked from: %+v", r)
		}
		if r := d.Carrel("vm", "rm", "--force", "snap"); r.Code == 0 || !strings.Contains(r.Stderr, "snapb") {
			t.Errorf("deleting the vm a fork stands on: %+v", r)
		}
	})

	t.Run("guest checkpoint", func(t *testing.T) {
		ask := func(name string) harness.Result {
			return d.Carrel("exec", "snap", "--", "carrel-agent", "request", "checkpoint", "--name", name, "--note", "tests pass")
		}
		// The default policy lets the guest ask for nothing.
		if r := ask("green"); r.Code != 1 || !strings.Contains(r.Stderr, "denied") || !strings.Contains(r.Stderr, "carrel.guest.default_deny") {
			t.Errorf("checkpoint under the default policy: %+v", r)
		}
		d.ApplyPolicy("checkpoints", func(s map[string]any) {
			s["guest"].(map[string]any)["allowed_requests"] = []string{"checkpoint"}
		}, "--vm", "snap")
		if r := ask("green"); r.Code != 0 || !strings.Contains(r.Stdout, `"green"`) {
			t.Fatalf("checkpoint allowed by policy: %+v", r)
		}
		if out := d.Must("vm", "snapshot", "ls", "snap"); !strings.Contains(out, "green") || !strings.Contains(out, "guest") {
			t.Errorf("the guest's checkpoint is not listed as the guest's:\n%s", out)
		}
		// A flood: a few more are taken, the rest refused, all recorded.
		r := d.Carrel("exec", "snap", "--", "sh", "-c",
			"for i in 1 2 3 4 5 6; do carrel-agent request checkpoint --name flood-$i; done")
		if n := strings.Count(r.Stderr, "rate limit"); n < 3 {
			t.Errorf("a flood of checkpoints: %d refused by the rate limit: %+v", n, r)
		}
		log, err := os.ReadFile(filepath.Join(d.State, "audit", "records.log"))
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range []string{`"kind":"guest.request"`, `"outcome":"denied"`, `"outcome":"done"`, `"outcome":"rate-limited"`} {
			if !strings.Contains(string(log), want) {
				t.Errorf("the audit log has no %s", want)
			}
		}
		var ls struct {
			Snapshots []struct {
				Name string `json:"name"`
			} `json:"snapshots"`
		}
		if err := json.Unmarshal([]byte(d.Must("vm", "snapshot", "ls", "snap", "--output", "json")), &ls); err != nil {
			t.Fatal(err)
		}
		for _, s := range ls.Snapshots {
			if s.Name == "green" || strings.HasPrefix(s.Name, "flood-") {
				d.Must("vm", "snapshot", "rm", "snap", s.Name)
			}
		}
		// The VM still runs and counts.
		n := count(t, d, "snap")
		time.Sleep(500 * time.Millisecond)
		if count(t, d, "snap") <= n {
			t.Error("the vm stopped counting after the guest's checkpoints")
		}
	})

	t.Run("damaged", func(t *testing.T) {
		d.Must("vm", "snapshot", "snap", "--name", "s2")
		pid := func() int {
			v, _ := vmNamed(t, d, "snap")
			return v.Pid
		}
		before := pid()
		state := filepath.Join(d.State, "vms", "snap", "snapshots", "s2", "state")
		b, err := os.ReadFile(state)
		if err != nil {
			t.Fatal(err)
		}
		b[len(b)/2] ^= 0xff
		if err := os.WriteFile(state, b, 0o400); err != nil {
			t.Fatal(err)
		}
		r := d.Carrel("vm", "restore", "snap", "s2")
		if r.Code == 0 || !strings.Contains(r.Stderr, "damaged") || !strings.Contains(r.Stderr, "changed since the snapshot") {
			t.Errorf("restore of a corrupted snapshot: %+v", r)
		}
		if err := os.Truncate(state, int64(len(b)/3)); err != nil {
			t.Fatal(err)
		}
		if r := d.Carrel("vm", "restore", "snap", "s2"); r.Code == 0 || !strings.Contains(r.Stderr, "damaged") {
			t.Errorf("restore of a truncated snapshot: %+v", r)
		}
		if r := d.Carrel("vm", "restore", "snap", "nope"); r.Code == 0 || !strings.Contains(r.Stderr, "no snapshot") {
			t.Errorf("restore of a missing snapshot: %+v", r)
		}
		if got := pid(); got != before {
			t.Errorf("a refused restore replaced the vm's qemu: pid %d, was %d", got, before)
		}
		n := count(t, d, "snap")
		time.Sleep(500 * time.Millisecond)
		if count(t, d, "snap") <= n {
			t.Error("the vm stopped counting after a refused restore")
		}
		d.Must("vm", "snapshot", "rm", "snap", "s2")
	})

	d.Must("vm", "rm", "--force", "snapb")
	d.Must("vm", "snapshot", "rm", "snap", "fork-snapb")
	if out := d.Must("audit", "verify", "--dir", filepath.Join(d.State, "audit")); !strings.Contains(out, "ok: the log is intact") {
		t.Errorf("audit verify: %s", out)
	}
	d.Must("vm", "rm", "--force", "snap")
	if left, _ := os.ReadDir(filepath.Join(d.State, "vms")); len(left) != 0 {
		t.Errorf("state left behind: %v", left)
	}
}

// TestSnapshotCarreldKilled: carreld killed (SIGKILL) during a snapshot, a
// fork and a restore. After the restart each finished or left nothing
// half-done: the VM is adopted and runs on whole disks, no unfinished
// snapshot is listed or left on disk, and a half-made fork is gone.
func TestSnapshotCarreldKilled(t *testing.T) {
	d := harness.New(t)
	d.Start()
	d.BuildImage()
	d.Must("vm", "create", "k", "--memory", "256M")
	dir := filepath.Join(d.State, "vms", "k")
	whole := func(when string) {
		t.Helper()
		v, ok := vmNamed(t, d, "k")
		if !ok {
			t.Fatalf("%s: the vm is gone", when)
		}
		if v.State != "VM_STATE_RUNNING" {
			d.Must("vm", "start", "k")
		}
		// An adopted VM's agent answers once its link is back.
		waitFor(t, 30*time.Second, "the agent after "+when, func() bool {
			v, _ := vmNamed(t, d, "k")
			return v.AgentState == "AGENT_STATE_READY"
		})
		if out := d.Must("exec", "k", "--", "sh", "-c", "echo ok > /workspace/ok; cat /workspace/ok"); out != "ok\n" {
			t.Errorf("%s: exec %q", when, out)
		}
		rec, err := os.ReadFile(filepath.Join(dir, "vm.json"))
		if err != nil || strings.Contains(string(rec), "pending_disks") {
			t.Errorf("%s: record %s %v", when, rec, err)
		}
		ents, _ := os.ReadDir(filepath.Join(dir, "snapshots"))
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), ".") {
				t.Errorf("%s: %s left in snapshots/", when, e.Name())
			}
		}
	}
	// A full disk: the VM's snapshots live on a file system of 16 MiB,
	// which the state (about 100 MiB) cannot fit. The snapshot fails with
	// the reason, none is listed or left, and the VM runs on, on whole
	// disks.
	snaps := filepath.Join(dir, "snapshots")
	if err := os.MkdirAll(snaps, 0o700); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", snaps).CombinedOutput(); err != nil {
		t.Fatalf("mount a small file system for the snapshots: %v: %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("umount", snaps).Run() })
	d.Must("exec", "k", "--", "sh", "-c", "echo before > /workspace/before")
	r := d.Carrel("vm", "snapshot", "k", "--name", "full")
	if r.Code == 0 || !strings.Contains(r.Stderr, "no space left on device") {
		t.Errorf("a snapshot onto a full disk: %+v", r)
	}
	if out := d.Must("vm", "snapshot", "ls", "k", "--output", "json"); strings.Contains(out, "full") {
		t.Errorf("the failed snapshot is listed: %s", out)
	}
	if out := d.Must("exec", "k", "--", "cat", "/workspace/before"); out != "before\n" {
		t.Errorf("after the failed snapshot: %q", out)
	}
	whole("a snapshot onto a full disk")
	if out, err := exec.Command("umount", snaps).CombinedOutput(); err != nil {
		t.Fatalf("umount: %v: %s", err, out)
	}
	// The VM still snapshots once there is room.
	d.Must("vm", "snapshot", "k", "--name", "roomy")
	d.Must("vm", "snapshot", "rm", "k", "roomy")

	for i, delay := range []time.Duration{100 * time.Millisecond, 300 * time.Millisecond, 600 * time.Millisecond} {
		name := "k" + strconv.Itoa(i)
		done := make(chan harness.Result, 1)
		go func() { done <- d.Carrel("vm", "snapshot", "k", "--name", name) }()
		time.Sleep(delay)
		d.Kill()
		<-done
		d.Start()
		whole("after a snapshot cut " + delay.String() + " in")
	}
	d.Must("vm", "snapshot", "k", "--name", "good")

	done := make(chan harness.Result, 1)
	go func() { done <- d.Carrel("vm", "fork", "k", "kf", "--snapshot", "good") }()
	time.Sleep(time.Second)
	d.Kill()
	<-done
	d.Start()
	if v, ok := vmNamed(t, d, "kf"); ok {
		if v.State != "VM_STATE_RUNNING" {
			t.Errorf("the fork survived its cut half-made: %+v", v)
		}
		d.Must("vm", "rm", "--force", "kf")
	} else if _, err := os.Stat(filepath.Join(d.State, "vms", "kf")); !os.IsNotExist(err) {
		t.Errorf("a cut fork left its directory: %v", err)
	}
	whole("after a fork cut midway")

	go func() { done <- d.Carrel("vm", "restore", "k", "good") }()
	time.Sleep(time.Second)
	d.Kill()
	<-done
	d.Start()
	whole("after a restore cut midway")
	d.Must("vm", "restore", "k", "good")
	whole("after a restore")
}
