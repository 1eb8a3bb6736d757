// Package node is carreld's side of a fleet: it runs the VMs a fleet
// engine places on this host, reports on them, and fences them when the
// engine cannot hear from the host. It knows nothing of any engine:
// supervisor/node/kube adapts it to Kubernetes (pods bound to the host's
// Node become runs), and a Slurm adapter would make jobs into runs.
//
// A run is one placement: one VM, booted from its image in a new session,
// named for the run's owner and labelled with the run's id. A run ends
// once, for good: a VM stopped by a fence, a drain or its own guest is
// never booted again for the same run; the engine starts a new run.
//
// Every action goes through carreld's API (VMs), so it is decided by
// policy and recorded exactly as the same action from the CLI.
package node

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"
)

// Labels carreld puts on a run's VM.
const (
	// LabelRun is the run's id (a pod's UID): a VM with it belongs to the
	// fleet, and to that run alone.
	LabelRun = "carrel.dev/run"
	// LabelOwner names what the run is of ("namespace/name").
	LabelOwner = "carrel.dev/owner"
)

// Run is what an engine asks this host to run.
type Run struct {
	// ID is the engine's id for the run, unique across runs.
	ID string
	// Owner names what the run is of, for people ("namespace/name").
	Owner string
	// VM is the VM's name on this host.
	VM string
	// Spec is the VM to boot.
	Spec Spec
	// GPUs are the PCI addresses of the GPUs the engine allocated.
	GPUs []string
	// Ended is set once the engine has seen the run end: it is not booted
	// again (after a carreld restart, say), only reported on.
	Ended bool
}

// Spec is the VM a run boots.
type Spec struct {
	Image          string `json:"image"`
	CPUs           uint32 `json:"cpus,omitempty"`
	MemoryBytes    uint64 `json:"memoryBytes,omitempty"`
	WorkspaceBytes uint64 `json:"workspaceBytes,omitempty"`
	Policy         string `json:"policy,omitempty"`
	// Deadline stops the VM this long after it was created.
	Deadline time.Duration `json:"deadline,omitempty"`
}

// Phase is where a run is on this host.
type Phase string

const (
	Booting  Phase = "Booting"  // its VM is being created and booted
	Running  Phase = "Running"  // its VM runs and its agent answers
	Stopping Phase = "Stopping" // its VM is being stopped
	Stopped  Phase = "Stopped"  // its VM stopped by itself, or by its deadline
	Failed   Phase = "Failed"   // its VM could not be booted, died, or was fenced
	Gone     Phase = "Gone"     // the engine withdrew it and its VM is deleted
)

// Status is what this host reports of a run.
type Status struct {
	Phase   Phase
	Session string
	GPUs    []string
	// Reason is a one-word cause (Fenced, NameTaken, BootFailed, ...) and
	// Message says more, for Failed and Stopped.
	Reason  string
	Message string
}

// VM is what the node needs of a VM carreld has.
type VM struct {
	Name    string
	Labels  map[string]string
	Session string
	// Running: the VM runs; Ready: its agent answers too.
	Running, Ready bool
	// Stopped: the VM is not running, and not starting or stopping.
	Stopped   bool
	LastError string
}

// VMs is carreld's API as the node calls it: each call decided by policy
// and recorded, as from the CLI.
type VMs interface {
	Create(ctx context.Context, name string, spec Spec, gpus []string, labels map[string]string) error
	List(ctx context.Context) ([]VM, error)
	// Stop stops a VM, gracefully unless force.
	Stop(ctx context.Context, name string, force bool) error
	Delete(ctx context.Context, name string) error
}

// Config configures an Agent.
type Config struct {
	VMs VMs
	Log *slog.Logger
	// FenceAfter is how long the engine may go unheard before the host
	// fences: carreld stops every run's VM and refuses their guests'
	// calls. It must be carreld's own (supervisor/fence), well under the
	// time after which the engine declares the host lost.
	FenceAfter time.Duration
	// StopTimeout bounds a graceful stop before the VM is stopped by force.
	StopTimeout time.Duration
	// OnChange is called after a run's status changes.
	OnChange func()
	// now is the clock (monotonic); tests replace it.
	now func() time.Time
}

// Agent runs the runs an engine gives it.
type Agent struct {
	cfg Config
	log *slog.Logger

	mu   sync.Mutex
	runs map[string]*run // by run id
	// heard is when the last successful exchange with the engine began,
	// by the monotonic clock: the engine heard from the host after it.
	heard  time.Time
	fenced bool
	wake   chan struct{}
}

type run struct {
	Run
	phase   Phase // Booting until the worker is done booting it
	reason  string
	message string
	ending  bool // the engine withdrew it: the worker stops and deletes it
	fenced  bool
	done    chan struct{} // the worker has returned
	cancel  context.CancelFunc
}

// New returns an Agent. It counts as just heard from its engine.
func New(cfg Config) *Agent {
	if cfg.now == nil {
		cfg.now = time.Now
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.StopTimeout == 0 {
		cfg.StopTimeout = 30 * time.Second
	}
	if cfg.OnChange == nil {
		cfg.OnChange = func() {}
	}
	return &Agent{cfg: cfg, log: cfg.Log, runs: map[string]*run{}, heard: cfg.now(), wake: make(chan struct{}, 1)}
}

// Heard says that an exchange with the engine that began at start (a
// lease renewal) succeeded. Once fenced, the host stays fenced for the
// runs it fenced; new runs may start again.
func (a *Agent) Heard(start time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if start.After(a.heard) {
		a.heard = start
	}
	if a.fenced && a.cfg.now().Sub(a.heard) < a.cfg.FenceAfter {
		a.fenced = false
		a.log.Info("fleet engine heard again: new runs may start")
	}
}

// Fenced reports whether the host has gone unheard too long.
func (a *Agent) Fenced() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.fencedLocked()
}

func (a *Agent) fencedLocked() bool {
	return a.fenced || a.cfg.FenceAfter > 0 && a.cfg.now().Sub(a.heard) >= a.cfg.FenceAfter
}

// ErrFenced is why a fenced run failed.
var ErrFenced = errors.New("the fleet engine did not hear from this host in time, so carreld fenced the run's VM: the engine may run its agent elsewhere")

// Sync makes the runs the engine wants the runs this host has: new ones
// are booted, withdrawn ones stopped and deleted, in the background.
// VMs labelled as runs the engine no longer has are withdrawn too (after
// a restart of carreld, say), except those of the runs in keep, which
// the engine still has but could not say more of just now. Runs gone
// and withdrawn are forgotten.
func (a *Agent) Sync(ctx context.Context, want []Run, keep []string) error {
	vms, err := a.cfg.VMs.List(ctx)
	if err != nil {
		return fmt.Errorf("list vms: %w", err)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	wanted := map[string]bool{}
	for _, id := range keep {
		wanted[id] = true
	}
	for id, r := range a.runs {
		if r.phase == Gone && !slices.ContainsFunc(want, func(w Run) bool { return w.ID == id }) {
			delete(a.runs, id)
		}
	}
	for _, w := range want {
		wanted[w.ID] = true
		if r, ok := a.runs[w.ID]; ok {
			r.Ended = r.Ended || w.Ended
			continue
		}
		r := &run{Run: w, phase: Booting, done: make(chan struct{})}
		a.runs[w.ID] = r
		a.start(ctx, r, vms)
	}
	for id, r := range a.runs {
		if !wanted[id] && !r.ending && r.phase != Gone {
			a.withdraw(ctx, r)
		}
	}
	// VMs of runs this agent has not met: from before a restart.
	for _, v := range vms {
		id := v.Labels[LabelRun]
		if id == "" || wanted[id] || a.runs[id] != nil {
			continue
		}
		r := &run{Run: Run{ID: id, Owner: v.Labels[LabelOwner], VM: v.Name}, phase: Stopping, done: make(chan struct{})}
		close(r.done) // it has no worker to wait for
		a.runs[id] = r
		a.withdraw(ctx, r)
	}
	return nil
}

// start begins a new run's worker. A run the engine saw end, or whose
// VM exists already (carreld restarted), is not booted again.
func (a *Agent) start(ctx context.Context, r *run, vms []VM) {
	var have *VM
	for i := range vms {
		if vms[i].Name == r.VM {
			have = &vms[i]
		}
	}
	switch {
	case have != nil && have.Labels[LabelRun] == r.ID:
		r.phase = Running // reported from the VM itself
		close(r.done)
		return
	case r.Ended:
		r.phase, r.reason, r.message = Failed, "Ended", "the run ended before this host restarted"
		close(r.done)
		return
	case have != nil:
		r.phase, r.reason = Failed, "NameTaken"
		r.message = fmt.Sprintf("this host already has a VM named %s, not of this run: it runs one VM of a name", r.VM)
		close(r.done)
		return
	case a.fencedLocked():
		r.phase, r.reason, r.message = Failed, "Fenced", ErrFenced.Error()
		r.fenced = true
		close(r.done)
		return
	}
	wctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	r.cancel = cancel
	go a.boot(wctx, r)
}

// boot creates and boots a run's VM.
func (a *Agent) boot(ctx context.Context, r *run) {
	defer close(r.done)
	labels := map[string]string{LabelRun: r.ID, LabelOwner: r.Owner}
	a.log.Info("fleet run: booting its VM", "vm", r.VM, "run", r.ID, "owner", r.Owner, "gpus", r.GPUs)
	err := a.cfg.VMs.Create(ctx, r.VM, r.Spec, r.GPUs, labels)
	a.mu.Lock()
	switch {
	case r.fenced: // reported as such already
	case err != nil:
		r.phase, r.reason, r.message = Failed, "BootFailed", err.Error()
		a.log.Error("fleet run: VM not booted", "vm", r.VM, "run", r.ID, "err", err)
	default:
		r.phase = Running
	}
	a.mu.Unlock()
	a.cfg.OnChange()
}

// withdraw stops and deletes a run's VM once its worker is done.
func (a *Agent) withdraw(ctx context.Context, r *run) {
	r.ending = true
	if r.cancel != nil {
		r.cancel()
	}
	go func() {
		<-r.done
		ctx := context.WithoutCancel(ctx)
		a.log.Info("fleet run withdrawn: stopping and deleting its VM", "vm", r.VM, "run", r.ID)
		a.setPhase(r, Stopping)
		err := a.remove(ctx, r)
		a.mu.Lock()
		if err != nil {
			// Left for the next Sync to try again.
			a.log.Error("fleet run: VM not removed", "vm", r.VM, "run", r.ID, "err", err)
			r.ending = false
			r.phase, r.reason, r.message = Failed, "RemoveFailed", err.Error()
			r.done = make(chan struct{})
			close(r.done)
		} else {
			r.phase = Gone
		}
		a.mu.Unlock()
		a.cfg.OnChange()
	}()
}

// remove stops a run's VM, gracefully within StopTimeout and by force
// after it, and deletes it. A VM that is not the run's is left alone.
func (a *Agent) remove(ctx context.Context, r *run) error {
	vms, err := a.cfg.VMs.List(ctx)
	if err != nil {
		return err
	}
	var v *VM
	for i := range vms {
		if vms[i].Name == r.VM && vms[i].Labels[LabelRun] == r.ID {
			v = &vms[i]
		}
	}
	if v == nil {
		return nil
	}
	if !v.Stopped {
		sctx, cancel := context.WithTimeout(ctx, a.cfg.StopTimeout)
		err := a.cfg.VMs.Stop(sctx, r.VM, false)
		cancel()
		if err != nil {
			a.log.Warn("fleet run: graceful stop failed; stopping by force", "vm", r.VM, "err", err)
			if err := a.cfg.VMs.Stop(ctx, r.VM, true); err != nil {
				return err
			}
		}
	}
	return a.cfg.VMs.Delete(ctx, r.VM)
}

func (a *Agent) setPhase(r *run, p Phase) {
	a.mu.Lock()
	r.phase = p
	a.mu.Unlock()
	a.cfg.OnChange()
}

// Statuses reports every run the agent has, by run id, as its VM is now.
func (a *Agent) Statuses(ctx context.Context) (map[string]Status, error) {
	vms, err := a.cfg.VMs.List(ctx)
	if err != nil {
		return nil, err
	}
	byName := map[string]VM{}
	for _, v := range vms {
		byName[v.Name] = v
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make(map[string]Status, len(a.runs))
	for id, r := range a.runs {
		st := Status{Phase: r.phase, Reason: r.reason, Message: r.message, GPUs: r.GPUs}
		v, ok := byName[r.VM]
		if ok && v.Labels[LabelRun] == id {
			st.Session = v.Session
			if r.phase == Running {
				switch {
				case v.Stopped && v.LastError != "":
					st.Phase, st.Reason, st.Message = Failed, "VMFailed", v.LastError
				case v.Stopped:
					st.Phase, st.Reason, st.Message = Stopped, "VMStopped", "the VM stopped"
				case !v.Ready:
					st.Phase = Booting
				}
			}
		} else if r.phase == Running {
			st.Phase, st.Reason, st.Message = Failed, "VMGone", "the run's VM is no longer on this host"
		}
		out[id] = st
	}
	return out, nil
}

// Watch marks the runs fenced when the engine has gone unheard for
// FenceAfter, checking every tick, until ctx ends.
func (a *Agent) Watch(ctx context.Context, tick time.Duration) {
	t := time.NewTicker(tick)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			a.fence()
		}
	}
}

// fence marks every live run Failed (Fenced) once the host is fenced:
// carreld's own fence (supervisor/fence), which hears of the same
// renewals, stops their VMs. The runs are over, and not booted again.
func (a *Agent) fence() {
	a.mu.Lock()
	if !a.fencedLocked() {
		a.mu.Unlock()
		return
	}
	if !a.fenced {
		a.log.Warn("fleet engine unheard: the host's fleet runs are fenced", "unheard", a.cfg.now().Sub(a.heard).Round(time.Millisecond), "after", a.cfg.FenceAfter)
	}
	a.fenced = true
	changed := false
	for _, r := range a.runs {
		if !r.fenced && (r.phase == Booting || r.phase == Running) {
			r.fenced, changed = true, true
			if r.cancel != nil {
				r.cancel()
			}
			r.phase, r.reason, r.message = Failed, "Fenced", ErrFenced.Error()
		}
	}
	a.mu.Unlock()
	if changed {
		a.cfg.OnChange()
	}
}
