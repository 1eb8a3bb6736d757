package node

import (
	"context"
	"errors"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/carrel-os/carrel/supervisor/internal/clocktest"
)

// fakeVMs is carreld's VMs in memory. Create adds a running VM whose
// agent does not answer yet. It is in this file, not a nodetest package,
// because the tests need the Agent's clock, and so package node.
type fakeVMs struct {
	mu     sync.Mutex
	vms    map[string]*VM
	calls  []string                     // every call that changed something, in order
	labels map[string]map[string]string // Create's labels, by VM
	// createErr fails Create; hang makes it wait for its context.
	createErr error
	hang      bool
	// gracefulErr fails a graceful Stop.
	gracefulErr error
}

var _ VMs = (*fakeVMs)(nil)

func newFakeVMs(have ...VM) *fakeVMs {
	f := &fakeVMs{vms: map[string]*VM{}, labels: map[string]map[string]string{}}
	for _, v := range have {
		f.vms[v.Name] = &v
	}
	return f
}

func (f *fakeVMs) Create(ctx context.Context, name string, _ Spec, _ []string, labels map[string]string) error {
	f.mu.Lock()
	f.calls = append(f.calls, "create "+name)
	f.labels[name] = maps.Clone(labels)
	if f.hang {
		f.mu.Unlock()
		<-ctx.Done()
		return ctx.Err()
	}
	defer f.mu.Unlock()
	if f.createErr != nil {
		return f.createErr
	}
	f.vms[name] = &VM{Name: name, Labels: maps.Clone(labels), Session: "session-" + name, Running: true}
	return nil
}

func (f *fakeVMs) List(context.Context) ([]VM, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []VM
	for _, v := range f.vms {
		out = append(out, *v)
	}
	return out, nil
}

func (f *fakeVMs) Stop(_ context.Context, name string, force bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if force {
		f.calls = append(f.calls, "force-stop "+name)
	} else {
		f.calls = append(f.calls, "stop "+name)
		if f.gracefulErr != nil {
			return f.gracefulErr
		}
	}
	v, ok := f.vms[name]
	if !ok {
		return errors.New("no such VM")
	}
	v.Running, v.Ready, v.Stopped = false, false, true
	return nil
}

func (f *fakeVMs) Delete(_ context.Context, name string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, "delete "+name)
	delete(f.vms, name)
	return nil
}

// set changes a VM, as carreld would on its own.
func (f *fakeVMs) set(name string, change func(*VM)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	change(f.vms[name])
}

func (f *fakeVMs) callsMade() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.calls)
}

const fenceAfter = 30 * time.Second

func newAgent(vms *fakeVMs) (*Agent, *clocktest.Clock) {
	c := clocktest.New(time.Unix(1_000_000, 0))
	return New(Config{VMs: vms, Log: slog.New(slog.DiscardHandler), FenceAfter: fenceAfter, StopTimeout: time.Second, now: c.Now}), c
}

func webRun() Run {
	return Run{ID: "uid-web", Owner: "ns/web", VM: "web", Spec: Spec{Image: "base"}, GPUs: []string{"0000:01:00.0"}}
}

// engineWants syncs a to the runs the engine wants.
func engineWants(t *testing.T, a *Agent, runs ...Run) {
	t.Helper()
	if err := a.Sync(context.Background(), runs, nil); err != nil {
		t.Fatal(err)
	}
}

func status(t *testing.T, a *Agent, id string) (Status, bool) {
	t.Helper()
	all, err := a.Statuses(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	st, ok := all[id]
	return st, ok
}

// waitPhase waits for run id to be reported in phase.
func waitPhase(t *testing.T, a *Agent, id string, phase Phase) Status {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		st, _ := status(t, a, id)
		if st.Phase == phase {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("run %s is %+v, want phase %s", id, st, phase)
		}
		time.Sleep(time.Millisecond)
	}
}

// waitCalls waits for the VMs to have been called n times.
func waitCalls(t *testing.T, vms *fakeVMs, n int) []string {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for len(vms.callsMade()) < n {
		if time.Now().After(deadline) {
			t.Fatalf("calls %q, want %d", vms.callsMade(), n)
		}
		time.Sleep(time.Millisecond)
	}
	return vms.callsMade()
}

// bootWeb boots webRun's VM and waits for it to be reported Running.
func bootWeb(t *testing.T, a *Agent, vms *fakeVMs) {
	t.Helper()
	engineWants(t, a, webRun())
	waitCalls(t, vms, 1)
	vms.set("web", func(v *VM) { v.Ready = true })
	waitPhase(t, a, "uid-web", Running)
}

// workerDone is closed once run id's worker has returned.
func workerDone(a *Agent, id string) <-chan struct{} {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.runs[id].done
}

func TestBoot(t *testing.T) {
	vms := newFakeVMs()
	a, _ := newAgent(vms)
	engineWants(t, a, webRun())
	if st, _ := status(t, a, "uid-web"); st.Phase != Booting {
		t.Fatalf("a new run is %+v, want Booting", st)
	}
	waitCalls(t, vms, 1)
	if st, _ := status(t, a, "uid-web"); st.Phase != Booting {
		t.Fatalf("a run whose agent does not answer yet is %+v, want Booting", st)
	}
	vms.set("web", func(v *VM) { v.Ready = true })
	st := waitPhase(t, a, "uid-web", Running)
	if st.Session != "session-web" || !slices.Equal(st.GPUs, webRun().GPUs) {
		t.Errorf("status %+v, want the VM's session and the run's GPUs", st)
	}
	want := map[string]string{LabelRun: "uid-web", LabelOwner: "ns/web"}
	if got := vms.labels["web"]; !maps.Equal(got, want) {
		t.Errorf("VM labelled %v, want %v", got, want)
	}

	engineWants(t, a, webRun())
	if calls := vms.callsMade(); !slices.Equal(calls, []string{"create web"}) {
		t.Errorf("calls %q, want one create", calls)
	}
}

func TestBootFailed(t *testing.T) {
	vms := newFakeVMs()
	vms.createErr = errors.New("no such image")
	a, _ := newAgent(vms)
	engineWants(t, a, webRun())
	st := waitPhase(t, a, "uid-web", Failed)
	if st.Reason != "BootFailed" || st.Message != "no such image" {
		t.Errorf("status %+v, want BootFailed with Create's error", st)
	}
}

func TestWithdraw(t *testing.T) {
	for _, graceful := range []bool{true, false} {
		vms := newFakeVMs()
		a, _ := newAgent(vms)
		bootWeb(t, a, vms)

		want := []string{"create web", "stop web", "delete web"}
		if !graceful {
			vms.gracefulErr = errors.New("the guest did not shut down")
			want = []string{"create web", "stop web", "force-stop web", "delete web"}
		}
		engineWants(t, a)
		waitPhase(t, a, "uid-web", Gone)
		if calls := vms.callsMade(); !slices.Equal(calls, want) {
			t.Errorf("graceful stop works %v: calls %q, want %q", graceful, calls, want)
		}
		engineWants(t, a) // a run gone and withdrawn is forgotten
		if st, ok := status(t, a, "uid-web"); ok {
			t.Errorf("run reported after the next sync: %+v", st)
		}
	}
}

func TestWithdrawUnknownRun(t *testing.T) {
	vms := newFakeVMs(
		VM{Name: "old", Labels: map[string]string{LabelRun: "uid-old", LabelOwner: "ns/old"}, Running: true, Ready: true},
		VM{Name: "mine", Labels: map[string]string{"team": "x"}, Running: true, Ready: true},
	)
	a, _ := newAgent(vms)
	engineWants(t, a)
	waitPhase(t, a, "uid-old", Gone)
	if calls := vms.callsMade(); !slices.Equal(calls, []string{"stop old", "delete old"}) {
		t.Errorf("calls %q, want the unknown run's VM stopped and deleted, no other", calls)
	}
}

func TestNameTaken(t *testing.T) {
	vms := newFakeVMs(VM{Name: "web", Labels: map[string]string{"team": "x"}, Running: true, Ready: true})
	a, _ := newAgent(vms)
	engineWants(t, a, webRun())
	if st, _ := status(t, a, "uid-web"); st.Phase != Failed || st.Reason != "NameTaken" {
		t.Errorf("status %+v, want Failed, NameTaken", st)
	}
	engineWants(t, a)
	waitPhase(t, a, "uid-web", Gone)
	if calls := vms.callsMade(); len(calls) != 0 {
		t.Errorf("calls %q, want the other VM left alone", calls)
	}
}

func TestEndedNotBooted(t *testing.T) {
	vms := newFakeVMs()
	a, _ := newAgent(vms)
	r := webRun()
	r.Ended = true
	engineWants(t, a, r)
	if st, _ := status(t, a, "uid-web"); st.Phase != Failed || st.Reason != "Ended" {
		t.Errorf("status %+v, want Failed, Ended", st)
	}
	if calls := vms.callsMade(); len(calls) != 0 {
		t.Errorf("calls %q, want none", calls)
	}
}

func TestVMStoppedByItself(t *testing.T) {
	for _, tc := range []struct {
		lastError            string
		phase                Phase
		reason, wantsMessage string
	}{
		{"", Stopped, "VMStopped", "the VM stopped"},
		{"qemu exited: status 1", Failed, "VMFailed", "qemu exited: status 1"},
	} {
		vms := newFakeVMs()
		a, _ := newAgent(vms)
		bootWeb(t, a, vms)
		vms.set("web", func(v *VM) { v.Running, v.Ready, v.Stopped, v.LastError = false, false, true, tc.lastError })
		st, _ := status(t, a, "uid-web")
		if st.Phase != tc.phase || st.Reason != tc.reason || st.Message != tc.wantsMessage {
			t.Errorf("last error %q: status %+v, want %s, %s, %q", tc.lastError, st, tc.phase, tc.reason, tc.wantsMessage)
		}
	}
}

func TestVMGone(t *testing.T) {
	vms := newFakeVMs()
	a, _ := newAgent(vms)
	bootWeb(t, a, vms)
	if err := vms.Delete(context.Background(), "web"); err != nil {
		t.Fatal(err)
	}
	if st, _ := status(t, a, "uid-web"); st.Phase != Failed || st.Reason != "VMGone" {
		t.Errorf("status %+v, want Failed, VMGone", st)
	}
}

func TestFence(t *testing.T) {
	vms := newFakeVMs()
	a, clk := newAgent(vms)
	bootWeb(t, a, vms)

	clk.Advance(fenceAfter - time.Nanosecond)
	a.fence()
	if st, _ := status(t, a, "uid-web"); st.Phase != Running {
		t.Fatalf("fenced before FenceAfter: %+v", st)
	}
	clk.Advance(time.Nanosecond)
	a.fence()
	if st, _ := status(t, a, "uid-web"); st.Phase != Failed || st.Reason != "Fenced" || st.Message != ErrFenced.Error() {
		t.Fatalf("status %+v, want Failed, Fenced", st)
	}

	db := Run{ID: "uid-db", Owner: "ns/db", VM: "db"}
	engineWants(t, a, webRun(), db)
	if st, _ := status(t, a, "uid-db"); st.Phase != Failed || st.Reason != "Fenced" {
		t.Errorf("a run new while fenced is %+v, want Failed, Fenced", st)
	}
	if calls := vms.callsMade(); !slices.Equal(calls, []string{"create web"}) {
		t.Errorf("calls %q: a run was booted while fenced", calls)
	}

	// Heard again: new runs boot; the fenced ones stay over.
	a.Heard(clk.Now())
	ci := Run{ID: "uid-ci", Owner: "ns/ci", VM: "ci"}
	engineWants(t, a, webRun(), db, ci)
	waitCalls(t, vms, 2)
	if st, _ := status(t, a, "uid-web"); st.Phase != Failed || st.Reason != "Fenced" {
		t.Errorf("a fenced run is %+v once heard again, want still Failed, Fenced", st)
	}
}

func TestFenceWhileBooting(t *testing.T) {
	vms := newFakeVMs()
	vms.hang = true
	a, clk := newAgent(vms)
	engineWants(t, a, webRun())
	waitCalls(t, vms, 1)
	clk.Advance(fenceAfter)
	a.fence()
	select {
	case <-workerDone(a, "uid-web"): // its Create was cancelled
	case <-time.After(5 * time.Second):
		t.Fatal("the fence did not cancel the run's boot")
	}
	if st, _ := status(t, a, "uid-web"); st.Phase != Failed || st.Reason != "Fenced" {
		t.Errorf("status %+v, want Failed, Fenced", st)
	}
}

// TestKeep: a run the engine still has, but could not say more of just
// now (its pod could not be checked), keeps its VM, and is not booted.
func TestKeep(t *testing.T) {
	vms := newFakeVMs(VM{Name: "web", Labels: map[string]string{LabelRun: "uid-web", LabelOwner: "ns/web"}, Running: true, Ready: true})
	a, _ := newAgent(vms)
	if err := a.Sync(context.Background(), nil, []string{"uid-web"}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(10 * time.Millisecond)
	if calls := vms.callsMade(); len(calls) != 0 {
		t.Fatalf("calls %q for a run kept", calls)
	}
	if err := a.Sync(context.Background(), nil, nil); err != nil {
		t.Fatal(err)
	}
	waitCalls(t, vms, 2)
	if calls := vms.callsMade(); !slices.Equal(calls, []string{"stop web", "delete web"}) {
		t.Errorf("calls %q once the run is no longer kept, want it withdrawn", calls)
	}
}
