package vm

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/supervisor/registry"
)

// TestOperatorPause: a paused VM refuses calls, keeps its pause through
// carreld's own hold and through a restart, and a stop clears it.
func TestOperatorPause(t *testing.T) {
	e := newEnv(t)
	l := &eventLog{}
	e.withEvents(l)
	ctx := context.Background()
	a := e.create(t, "a")
	fake := e.drv.VM(a.Instance.PID)

	rec, err := e.m.Pause(ctx, "a")
	if err != nil || !rec.Paused || !fake.Paused() {
		t.Fatalf("pause: %+v %v, fake paused %v", rec, err, fake.Paused())
	}
	if _, err := e.m.Link("a"); !errors.Is(err, ErrPaused) || !strings.Contains(err.Error(), "carrel vm resume a") {
		t.Errorf("link of a paused vm: %v", err)
	}
	if _, err := e.m.Pause(ctx, "a"); err != nil {
		t.Errorf("second pause: %v", err)
	}
	// carreld's hold comes and goes: the operator's pause stands.
	if err := e.m.PauseAll(ctx, "audit log unavailable: test"); err != nil {
		t.Fatal(err)
	}
	if err := e.m.ResumeAll(ctx); err != nil {
		t.Fatal(err)
	}
	if !fake.Paused() {
		t.Fatal("ResumeAll resumed a vm its operator paused")
	}

	// A new carreld keeps it paused; one that finds it running against its
	// record pauses it.
	e.m.Close()
	e.m = e.manager()
	if err := e.m.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if st, _ := e.m.Get("a"); !st.Paused || !fake.Paused() {
		t.Fatalf("after restart: record paused %v, vm paused %v", st.Paused, fake.Paused())
	}
	e.m.Close()
	if err := e.drv.Resume(ctx, *a.Instance); err != nil {
		t.Fatal(err)
	}
	e.withEvents(l)
	if err := e.m.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if !fake.Paused() {
		t.Fatal("adopted vm running against its paused record")
	}

	rec, err = e.m.Resume(ctx, "a")
	if err != nil || rec.Paused || fake.Paused() {
		t.Fatalf("resume: %+v %v, fake paused %v", rec, err, fake.Paused())
	}
	if _, err := e.m.Link("a"); err != nil {
		t.Errorf("link after resume: %v", err)
	}
	if k := l.kinds(); !strings.Contains(k, "paused,") || !strings.Contains(k, "resumed") {
		t.Errorf("events %s", k)
	}

	// A paused VM that stops is not paused at its next boot.
	if _, err := e.m.Pause(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.m.Stop(ctx, "a", true); err != nil {
		t.Fatal(err)
	}
	if r, _ := e.reg.Get("a"); r.Paused || r.State != registry.StateStopped {
		t.Errorf("stopped record %+v", r)
	}
	if _, err := e.m.Pause(ctx, "a"); !errors.Is(err, ErrNotRunning) {
		t.Errorf("pause of a stopped vm: %v", err)
	}
}

// TestAdoptResumesAHeldVM: a VM the previous carreld held paused (its
// audit log had failed) runs again under the next one.
func TestAdoptResumesAHeldVM(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	a := e.create(t, "a")
	if err := e.m.PauseAll(ctx, "audit log unavailable: test"); err != nil {
		t.Fatal(err)
	}
	e.m.Close()
	e.m = e.manager()
	if err := e.m.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if e.drv.VM(a.Instance.PID).Paused() {
		t.Fatal("a held vm stays paused under a new carreld")
	}
}
