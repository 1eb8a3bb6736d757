package vm

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/carrel-os/carrel/supervisor/registry"
)

// eventLog collects the events a manager reports.
type eventLog struct {
	mu   sync.Mutex
	evs  []Event
	fail map[EventKind]error
}

func (l *eventLog) on(_ context.Context, ev Event) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.evs = append(l.evs, ev)
	return l.fail[ev.Kind]
}

func (l *eventLog) kinds() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var ks []string
	for _, ev := range l.evs {
		ks = append(ks, string(ev.Kind))
	}
	return strings.Join(ks, ",")
}

func (e *env) withEvents(l *eventLog) {
	e.m.Close()
	e.m = New(Config{Registry: e.reg, Images: e.img, Driver: e.drv, BootTimeout: 2 * time.Second, StopTimeout: time.Second, OnEvent: l.on})
}

// TestLifecycleEvents: every step is reported with the run's session; a
// new boot is a new session.
func TestLifecycleEvents(t *testing.T) {
	e := newEnv(t)
	l := &eventLog{}
	e.withEvents(l)
	ctx := context.Background()
	rec := e.create(t, "a")
	if !strings.HasPrefix(rec.Session, "ses_") {
		t.Fatalf("session %q", rec.Session)
	}
	if _, err := e.m.Stop(ctx, "a", false); err != nil {
		t.Fatal(err)
	}
	rec2, err := e.m.Start(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	if rec2.Session == rec.Session || !strings.HasPrefix(rec2.Session, "ses_") {
		t.Errorf("second run's session %q (first %q)", rec2.Session, rec.Session)
	}
	if err := e.m.Delete(ctx, "a", true); err != nil {
		t.Fatal(err)
	}
	if got, want := l.kinds(), "created,starting,started,stopping,stopped,starting,started,stopping,stopped,removed"; got != want {
		t.Errorf("events %s, want %s", got, want)
	}
	for i, ev := range l.evs {
		want := rec.Session
		if i >= 5 {
			want = rec2.Session
		}
		if ev.Record.Session != want || ev.Record.Name != "a" {
			t.Errorf("event %d (%s): vm %q session %q, want %q", i, ev.Kind, ev.Record.Name, ev.Record.Session, want)
		}
	}
}

// TestUnrecordedStartIsRefused: a boot whose start cannot be recorded
// does not happen.
func TestUnrecordedStartIsRefused(t *testing.T) {
	e := newEnv(t)
	l := &eventLog{fail: map[EventKind]error{EventStarting: errors.New("disk full")}}
	e.withEvents(l)
	_, err := e.m.Create(context.Background(), CreateParams{Name: "a", Image: "dev"})
	if err == nil || !strings.Contains(err.Error(), "disk full") {
		t.Fatalf("create: %v", err)
	}
	if n := e.drv.Running(); n != 0 {
		t.Errorf("%d VMs started", n)
	}
	if _, err := e.reg.Get("a"); !errors.Is(err, registry.ErrNotFound) {
		t.Errorf("record left behind: %v", err)
	}
}

// TestPauseAll: every running VM is paused, and a VM booted while they
// are held is paused too; ResumeAll resumes them and reports both steps.
func TestPauseAll(t *testing.T) {
	e := newEnv(t)
	l := &eventLog{}
	e.withEvents(l)
	ctx := context.Background()
	a := e.create(t, "a")
	if err := e.m.PauseAll(ctx, "audit log unavailable: test"); err != nil {
		t.Fatal(err)
	}
	b := e.create(t, "b")
	for _, rec := range []registry.Record{a, b} {
		if !e.drv.VM(rec.Instance.PID).Paused() {
			t.Errorf("%s is not paused", rec.Name)
		}
		if st, _ := e.m.Get(rec.Name); !st.Held {
			t.Errorf("%s's status does not say paused", rec.Name)
		}
	}
	if err := e.m.ResumeAll(ctx); err != nil {
		t.Fatal(err)
	}
	for _, rec := range []registry.Record{a, b} {
		if e.drv.VM(rec.Instance.PID).Paused() {
			t.Errorf("%s is still paused", rec.Name)
		}
	}
	if k := l.kinds(); strings.Count(k, "paused") != 2 || strings.Count(k, "resumed") != 2 {
		t.Errorf("events %s", k)
	}
	// Nothing is held any more: a new VM runs.
	c := e.create(t, "c")
	if e.drv.VM(c.Instance.PID).Paused() {
		t.Error("a VM created after ResumeAll is paused")
	}
}
