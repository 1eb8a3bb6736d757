package vm

import (
	"connectrpc.com/connect"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/image/store"
	"github.com/carrel-os/carrel/image/store/storetest"
	"github.com/carrel-os/carrel/supervisor/agentlink"
	"github.com/carrel-os/carrel/supervisor/driver"
	"github.com/carrel-os/carrel/supervisor/driver/drivertest"
	"github.com/carrel-os/carrel/supervisor/registry"
)

type env struct {
	m   *Manager
	drv *drivertest.Driver
	reg *registry.Registry
	img *store.Store
	dir string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	dir := t.TempDir()
	img, _ := storetest.WithFakeImage(t, dir, "dev")
	reg, err := registry.Open(filepath.Join(dir, "vms"))
	if err != nil {
		t.Fatal(err)
	}
	e := &env{drv: drivertest.New(), reg: reg, img: img, dir: dir}
	e.m = e.manager()
	t.Cleanup(func() { e.m.Close() })
	return e
}

func (e *env) manager() *Manager {
	return New(Config{Registry: e.reg, Images: e.img, Driver: e.drv, BootTimeout: 2 * time.Second, StopTimeout: time.Second})
}

func (e *env) create(t *testing.T, name string) registry.Record {
	t.Helper()
	rec, err := e.m.Create(context.Background(), CreateParams{Name: name, Image: "dev"})
	if err != nil {
		t.Fatal(err)
	}
	return rec
}

func TestCreateExecStopDelete(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	rec := e.create(t, "demo")
	if rec.State != registry.StateRunning || rec.MemoryBytes != DefaultMemory || rec.CPUs != 1 || !strings.HasPrefix(rec.ImageDigest, "sha256:") {
		t.Errorf("record = %+v", rec)
	}
	st, err := e.m.Get("demo")
	if err != nil || st.Agent != agentlink.Ready {
		t.Fatalf("status = %+v, %v", st, err)
	}
	onDisk, err := e.reg.Get("demo")
	if err != nil || onDisk.State != registry.StateRunning || onDisk.Instance == nil {
		t.Fatalf("persisted = %+v, %v", onDisk, err)
	}

	link, err := e.m.Link("demo")
	if err != nil {
		t.Fatal(err)
	}
	agent, _ := link.Agent()
	s, err := agent.Exec(ctx, connect.NewRequest(&agentv1.ExecRequest{Argv: []string{"echo", "hi"}}))
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	for s.Receive() {
		out.Write(s.Msg().GetStdout())
	}
	if err := s.Err(); err != nil {
		t.Fatal(err)
	}
	if out.String() != "echo\nhi\n" {
		t.Errorf("exec output %q", out.String())
	}

	if err := e.m.Delete(ctx, "demo", false); !errors.Is(err, ErrRunning) {
		t.Errorf("delete running: %v", err)
	}
	if _, err := e.m.Stop(ctx, "demo", false); err != nil {
		t.Fatal(err)
	}
	if e.drv.Killed != 0 {
		t.Errorf("graceful stop killed the vm")
	}
	if st, _ := e.m.Get("demo"); st.State != registry.StateStopped || st.Instance != nil {
		t.Errorf("after stop: %+v", st)
	}
	if _, err := e.m.Link("demo"); !errors.Is(err, ErrNotRunning) {
		t.Errorf("link of a stopped vm: %v", err)
	}
	if _, err := e.m.Start(ctx, "demo"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.m.Start(ctx, "demo"); !errors.Is(err, ErrRunning) {
		t.Errorf("start of running vm: %v", err)
	}
	if err := e.m.Delete(ctx, "demo", true); err != nil {
		t.Fatal(err)
	}
	if e.drv.Killed != 1 || e.drv.Running() != 0 {
		t.Errorf("forced delete: killed %d, running %d", e.drv.Killed, e.drv.Running())
	}
	if _, err := e.m.Get("demo"); !errors.Is(err, ErrNotFound) {
		t.Errorf("get after delete: %v", err)
	}
	if _, err := os.Stat(e.reg.Dir("demo")); !os.IsNotExist(err) {
		t.Errorf("state dir left: %v", err)
	}
}

func TestCreateRejectsBadArgumentsAndCreatesNothing(t *testing.T) {
	e := newEnv(t)
	e.create(t, "taken")
	cases := []struct {
		p    CreateParams
		want error
	}{
		{CreateParams{Name: "Bad", Image: "dev"}, ErrInvalid},
		{CreateParams{Name: "../x", Image: "dev"}, ErrInvalid},
		{CreateParams{Name: "a", Image: ""}, ErrInvalid},
		{CreateParams{Name: "a", Image: "dev", MemoryBytes: 1 << 20}, ErrInvalid},
		{CreateParams{Name: "a", Image: "dev", MemoryBytes: (512 << 20) + 1}, ErrInvalid},
		{CreateParams{Name: "a", Image: "dev", CPUs: 65}, ErrInvalid},
		{CreateParams{Name: "a", Image: "nope"}, ErrImageMissing},
		{CreateParams{Name: "taken", Image: "dev"}, ErrExists},
	}
	for _, c := range cases {
		if _, err := e.m.Create(context.Background(), c.p); !errors.Is(err, c.want) {
			t.Errorf("%+v: err %v, want %v", c.p, err, c.want)
		}
	}
	if got := e.m.List(); len(got) != 1 {
		t.Errorf("vms: %+v", got)
	}
	recs, _ := e.reg.List()
	if len(recs) != 1 || e.drv.Running() != 1 {
		t.Errorf("records %d, running %d", len(recs), e.drv.Running())
	}
}

func TestBootFailureLeavesNothing(t *testing.T) {
	cases := []struct {
		name string
		b    drivertest.Behavior
		want string
	}{
		{"start fails", drivertest.Behavior{StartErr: errors.New("qemu: could not open kernel")}, "could not open kernel"},
		{"guest panics", drivertest.Behavior{Console: "booting\nKernel panic - not syncing: VFS\n", ExitOnResume: true}, "Kernel panic"},
		{"agent never answers", drivertest.Behavior{Console: "stuck in early boot\n", Silent: true}, "stuck in early boot"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t)
			e.drv.SetNext(c.b)
			start := time.Now()
			_, err := e.m.Create(context.Background(), CreateParams{Name: "broken", Image: "dev"})
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want it to contain %q", err, c.want)
			}
			if time.Since(start) > 5*time.Second {
				t.Errorf("create took %s to fail", time.Since(start))
			}
			if e.drv.Running() != 0 {
				t.Error("a fake qemu is still running")
			}
			if _, err := os.Stat(e.reg.Dir("broken")); !os.IsNotExist(err) {
				t.Errorf("state left: %v", err)
			}
			if len(e.m.List()) != 0 {
				t.Error("vm listed")
			}
		})
	}
}

func TestCloseLeavesVMsRunningAndRecorded(t *testing.T) {
	e := newEnv(t)
	rec := e.create(t, "demo")
	e.m.Close()
	time.Sleep(100 * time.Millisecond) // let any wrongly-fired watcher act
	if !e.drv.VM(rec.Instance.PID).Adopt() {
		t.Fatal("closing the manager stopped the vm")
	}
	if r, _ := e.reg.Get("demo"); r.State != registry.StateRunning || r.Instance == nil {
		t.Errorf("record after close: %+v", r)
	}
	if _, err := e.m.Create(context.Background(), CreateParams{Name: "late", Image: "dev"}); !errors.Is(err, ErrClosing) {
		t.Errorf("create after close: %v", err)
	}
}

func TestConcurrentCreatesOfOneName(t *testing.T) {
	e := newEnv(t)
	errs := make(chan error, 8)
	for i := 0; i < 8; i++ {
		go func() {
			_, err := e.m.Create(context.Background(), CreateParams{Name: "same", Image: "dev"})
			errs <- err
		}()
	}
	ok := 0
	for i := 0; i < 8; i++ {
		if err := <-errs; err == nil {
			ok++
		} else if !errors.Is(err, ErrExists) {
			t.Errorf("unexpected error: %v", err)
		}
	}
	if ok != 1 || e.drv.Running() != 1 {
		t.Errorf("%d creates succeeded, %d vms running; want 1 and 1", ok, e.drv.Running())
	}
}

func TestVsockCIDsAreUnique(t *testing.T) {
	e := newEnv(t)
	e.m = New(Config{Registry: e.reg, Images: e.img, Driver: e.drv, BootTimeout: 2 * time.Second, Vsock: true})
	seen := map[uint32]bool{}
	for _, n := range []string{"a", "b", "c"} {
		rec := e.create(t, n)
		if seen[rec.Instance.CID] || rec.Instance.CID < 3 {
			t.Errorf("vm %s got cid %d (seen %v)", n, rec.Instance.CID, seen)
		}
		seen[rec.Instance.CID] = true
	}
}

func TestVMThatExitsOnItsOwnIsMarkedStopped(t *testing.T) {
	e := newEnv(t)
	rec := e.create(t, "demo")
	e.drv.VM(rec.Instance.PID).Exit()
	deadline := time.Now().Add(5 * time.Second)
	for {
		// The record is changed in memory, then written: wait for both.
		st, _ := e.m.Get("demo")
		r, _ := e.reg.Get("demo")
		if st.State == registry.StateStopped && r != nil && r.State == registry.StateStopped {
			if st.LastError == "" || r.LastError == "" {
				t.Error("no last error recorded")
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("state = %s, persisted %+v", st.State, r)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestReconcile(t *testing.T) {
	e := newEnv(t)
	alive := e.create(t, "alive")
	dead := e.create(t, "dead")
	stopping := e.create(t, "stopping")
	e.m.Close() // carreld goes away; the VMs stay

	e.drv.VM(dead.Instance.PID).Exit()
	r, _ := e.reg.Get("stopping")
	r.State = registry.StateStopping
	e.reg.Put(r)
	// A create that was interrupted: record in state creating, VM running.
	inst, _ := e.drv.Start(context.Background(), driver.Spec{Name: "half"})
	e.reg.Put(&registry.Record{Name: "half", State: registry.StateCreating, Instance: &inst})
	// One interrupted before its instance was recorded: only the VM's
	// directory (QEMU's pid file) leads to it.
	early, _ := e.drv.Start(context.Background(), driver.Spec{Name: "early", Dir: e.reg.Dir("early")})
	e.reg.Put(&registry.Record{Name: "early", State: registry.StateCreating})
	// A start of a stopped VM that was interrupted.
	restarting, _ := e.drv.Start(context.Background(), driver.Spec{Name: "restarting", Dir: e.reg.Dir("restarting")})
	e.reg.Put(&registry.Record{Name: "restarting", State: registry.StateStarting})

	m := e.manager()
	defer m.Close()
	if err := m.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if st, err := m.Get("alive"); err != nil || st.State != registry.StateRunning || st.Instance.PID != alive.Instance.PID {
		t.Errorf("alive: %+v %v", st, err)
	}
	if st, _ := m.Get("dead"); st.State != registry.StateStopped || st.LastError == "" {
		t.Errorf("dead: %+v", st)
	}
	if st, _ := m.Get("stopping"); st.State != registry.StateStopped {
		t.Errorf("stopping: %+v", st)
	}
	if e.drv.VM(stopping.Instance.PID).Adopt() {
		t.Error("interrupted stop was not finished")
	}
	if _, err := m.Get("half"); !errors.Is(err, ErrNotFound) {
		t.Errorf("half-created vm kept: %v", err)
	}
	if e.drv.VM(inst.PID).Adopt() {
		t.Error("half-created vm still running")
	}
	if _, err := m.Get("early"); !errors.Is(err, ErrNotFound) || e.drv.VM(early.PID).Adopt() {
		t.Errorf("vm of a create interrupted before its instance was recorded: %v, running %v", err, e.drv.VM(early.PID).Adopt())
	}
	if st, err := m.Get("restarting"); err != nil || st.State != registry.StateStopped || e.drv.VM(restarting.PID).Adopt() {
		t.Errorf("interrupted start: %+v %v, running %v", st, err, e.drv.VM(restarting.PID).Adopt())
	}
	// The adopted VM's agent link comes back without a new boot.
	deadline := time.Now().Add(5 * time.Second)
	for {
		if st, _ := m.Get("alive"); st.Agent == agentlink.Ready {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("adopted vm's agent never ready")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if e.drv.Running() != 1 {
		t.Errorf("running fake vms: %d, want 1", e.drv.Running())
	}
}
