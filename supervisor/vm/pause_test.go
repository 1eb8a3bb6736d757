package vm

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/supervisor/agentlink"
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

// TestPauseHoldsTheLink: while carreld holds every VM paused, or an
// operator pauses one, its agent link is held (agentlink.Hold: no probes,
// no new connection, and a call the pause outlasts fails with the reason);
// a call in flight goes on through a short pause; ResumeAll leaves the
// link of a VM its operator paused held, and Resume releases it.
func TestPauseHoldsTheLink(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.create(t, "a")
	link, err := e.m.Link("a")
	if err != nil {
		t.Fatal(err)
	}
	callCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	s, _ := startCat(t, callCtx, link)

	if err := e.m.PauseAll(ctx, "audit log unavailable: disk full"); err != nil {
		t.Fatal(err)
	}
	if link.Held() == nil {
		t.Fatal("PauseAll left the link unheld")
	}
	if err := e.m.ResumeAll(ctx); err != nil {
		t.Fatal(err)
	}
	if link.Held() != nil {
		t.Fatal("the link is still held after ResumeAll")
	}
	if err := s.Send(&agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Stdin{Stdin: []byte("still here")}}); err != nil {
		t.Fatal(err)
	}
	if m, err := s.Receive(); err != nil || string(m.GetStdout()) != "still here" {
		t.Fatalf("the call in flight after a short pause: %v, %v", m, err)
	}

	if _, err := e.m.Pause(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if link.Held() == nil {
		t.Fatal("an operator's pause left the link unheld")
	}
	// carreld's hold comes and goes: the operator's pause still holds.
	if err := e.m.PauseAll(ctx, "audit log unavailable: test"); err != nil {
		t.Fatal(err)
	}
	if err := e.m.ResumeAll(ctx); err != nil {
		t.Fatal(err)
	}
	if link.Held() == nil {
		t.Fatal("ResumeAll released the link of a vm its operator paused")
	}
	if _, err := e.m.Resume(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if link.Held() != nil {
		t.Fatal("the link is still held after Resume")
	}
	if _, err := link.Health(ctx); err != nil {
		t.Fatalf("health after resume: %v", err)
	}
}

// TestLongPause: a pause that outlasts the agent connection (cut here as
// the host's HTTP/2 keepalive cuts it) fails the call in flight with the
// pause's reason and leaves the agent's health alone; a resume connects
// again, and a stop after such a pause still powers the guest off.
func TestLongPause(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	a := e.create(t, "a")
	fake := e.drv.VM(a.Instance.PID)
	link, err := e.m.Link("a")
	if err != nil {
		t.Fatal(err)
	}
	s, done := startCat(t, ctx, link)
	if _, err := e.m.Pause(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	fake.CutAgentConnections()
	ended := make(chan error, 1)
	go func() {
		for {
			if _, err := s.Receive(); err != nil {
				ended <- done(ctx, err)
				return
			}
		}
	}()
	select {
	case err := <-ended:
		if !errors.Is(err, agentlink.ErrHeld) || !strings.Contains(err.Error(), "carrel vm resume a") {
			t.Fatalf("the call the pause outlasted ended with %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the call whose connection was cut did not end")
	}
	if st, err := link.State(); st != agentlink.Ready {
		t.Errorf("agent %v (%v) after a long pause; want ready as before", st, err)
	}
	if _, err := e.m.Resume(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if _, err := link.Health(ctx); err != nil {
		t.Fatalf("health after the resume: %v", err)
	}

	if _, err := e.m.Pause(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	fake.CutAgentConnections()
	killed := e.drv.Killed
	if _, err := e.m.Stop(ctx, "a", false); err != nil {
		t.Fatal(err)
	}
	if e.drv.Killed != killed {
		t.Error("a vm stopped after a long pause was killed, not powered off")
	}
}

// startCat starts a Process call through link that stays in flight (the
// fake agent echoes stdin until it closes), and returns it with the done
// its errors go through.
func startCat(t *testing.T, ctx context.Context, link *agentlink.Link) (*connect.BidiStreamForClient[agentv1.ProcessInput, agentv1.ExecResponse], func(context.Context, error) error) {
	t.Helper()
	c, done := link.Agent()
	s := c.Process(ctx)
	t.Cleanup(func() { s.CloseRequest() })
	if err := s.Send(&agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Start{Start: &agentv1.ExecRequest{Argv: []string{"cat"}}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Receive(); err != nil {
		t.Fatalf("the call did not start: %v", err)
	}
	return s, done
}
