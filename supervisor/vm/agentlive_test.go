package vm

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/carrel-os/carrel/supervisor/agentlink"
	"github.com/carrel-os/carrel/supervisor/registry"
)

// liveCalls records the AgentLive calls of a manager.
type liveCalls struct {
	mu    sync.Mutex
	calls []liveCall
}

type liveCall struct {
	ctx    context.Context
	rec    registry.Record
	link   *agentlink.Link
	policy func() string
}

func (l *liveCalls) hook(ctx context.Context, v Live) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.calls = append(l.calls, liveCall{ctx, v.Record, v.Link, v.Policy})
}

func (l *liveCalls) get() []liveCall {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]liveCall(nil), l.calls...)
}

func ended(ctx context.Context) bool {
	select {
	case <-ctx.Done():
		return true
	case <-time.After(2 * time.Second):
		return false
	}
}

// TestAgentLive checks that AgentLive is called once a VM is running, with
// its record (its session set) and link, and a context that ends when the
// VM stops; and again, for a VM adopted after a restart, with a context
// that ends when the manager closes.
func TestAgentLive(t *testing.T) {
	e := newEnv(t)
	var live liveCalls
	e.m.Close()
	mk := func() *Manager {
		m := e.manager()
		m.cfg.AgentLive = live.hook
		return m
	}
	e.m = mk()
	rec := e.create(t, "demo")
	calls := live.get()
	if len(calls) != 1 || calls[0].rec.Name != "demo" || calls[0].rec.Session != rec.Session || calls[0].link == nil {
		t.Fatalf("AgentLive calls after create: %+v", calls)
	}
	if calls[0].ctx.Err() != nil {
		t.Fatal("the live context ended while the vm runs")
	}
	// The policy is read when asked: a binding made while the VM runs shows.
	if p := calls[0].policy(); p != "default" {
		t.Errorf("policy while live: %q", p)
	}
	if err := e.m.SetPolicy(context.Background(), "demo", "strict"); err != nil {
		t.Fatal(err)
	}
	if p := calls[0].policy(); p != "strict" {
		t.Errorf("policy after a new binding: %q, want strict", p)
	}
	if _, err := e.m.Stop(context.Background(), "demo", true); err != nil {
		t.Fatal(err)
	}
	if !ended(calls[0].ctx) {
		t.Error("the live context did not end when the vm stopped")
	}

	if _, err := e.m.Start(context.Background(), "demo"); err != nil {
		t.Fatal(err)
	}
	e.m.Close() // carreld goes; the VM stays
	calls = live.get()
	if len(calls) != 2 || !ended(calls[1].ctx) {
		t.Fatalf("after a start and a close: %d calls; the last context ended: %v", len(calls), len(calls) == 2 && calls[1].ctx.Err() != nil)
	}
	e.m = mk()
	if err := e.m.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	calls = live.get()
	if len(calls) != 3 || calls[2].rec.Name != "demo" || calls[2].rec.Session != calls[1].rec.Session || calls[2].ctx.Err() != nil {
		t.Fatalf("AgentLive calls after adopting: %+v", calls)
	}
}
