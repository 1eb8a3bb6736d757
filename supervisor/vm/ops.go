package vm

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/supervisor/agentlink"
	"github.com/carrel-os/carrel/supervisor/registry"
)

// Status is a VM's record plus its live agent state.
type Status struct {
	registry.Record
	Agent     agentlink.State
	Transport string
}

func (m *Manager) get(name string) (*machine, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	mc, ok := m.vms[name]
	if !ok {
		return nil, fmt.Errorf("%w: %q", ErrNotFound, name)
	}
	return mc, nil
}

func (mc *machine) status() Status {
	st := Status{Record: mc.snapshot(), Agent: agentlink.Unknown}
	mc.mu.Lock()
	defer mc.mu.Unlock()
	if mc.link != nil {
		st.Agent, _ = mc.link.State()
		if info := mc.link.Info(); info != nil {
			st.Transport = info.Transport
		}
	}
	return st
}

// Get returns one VM's status.
func (m *Manager) Get(name string) (Status, error) {
	mc, err := m.get(name)
	if err != nil {
		return Status{}, err
	}
	return mc.status(), nil
}

// List returns every VM's status, sorted by name. VMs still being created
// are included.
func (m *Manager) List() []Status {
	m.mu.Lock()
	mcs := make([]*machine, 0, len(m.vms))
	for _, mc := range m.vms {
		mcs = append(mcs, mc)
	}
	m.mu.Unlock()
	out := make([]Status, 0, len(mcs))
	for _, mc := range mcs {
		out = append(out, mc.status())
	}
	sortStatuses(out)
	return out
}

func sortStatuses(s []Status) {
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j].Name < s[j-1].Name; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
}

// Running counts running VMs.
func (m *Manager) Running() int {
	n := 0
	for _, st := range m.List() {
		if st.State == registry.StateRunning {
			n++
		}
	}
	return n
}

// lock takes mc's operation lock, or fails with ErrBusy once ctx ends.
func lock(ctx context.Context, mc *machine) error {
	for {
		if mc.op.TryLock() {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w: %w", ErrBusy, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Start boots a stopped VM. Starting a running VM is an error.
func (m *Manager) Start(ctx context.Context, name string) (registry.Record, error) {
	mc, err := m.get(name)
	if err != nil {
		return registry.Record{}, err
	}
	if err := lock(ctx, mc); err != nil {
		return registry.Record{}, err
	}
	defer mc.op.Unlock()
	if st := mc.snapshot().State; st != registry.StateStopped {
		return registry.Record{}, fmt.Errorf("%w: %q is %s", ErrRunning, name, st)
	}
	if err := m.boot(ctx, mc); err != nil {
		return registry.Record{}, err
	}
	return mc.snapshot(), nil
}

// Stop powers a VM off: it asks the guest agent to shut down, waits up to
// the stop timeout, then kills QEMU. With force it kills at once. Stopping
// a stopped VM returns it unchanged.
func (m *Manager) Stop(ctx context.Context, name string, force bool) (registry.Record, error) {
	mc, err := m.get(name)
	if err != nil {
		return registry.Record{}, err
	}
	if err := lock(ctx, mc); err != nil {
		return registry.Record{}, err
	}
	defer mc.op.Unlock()
	return m.stopLocked(ctx, mc, force)
}

func (m *Manager) stopLocked(ctx context.Context, mc *machine, force bool) (registry.Record, error) {
	mc.mu.Lock()
	if mc.rec.State == registry.StateStopped || mc.rec.Instance == nil {
		mc.mu.Unlock()
		return mc.snapshot(), nil
	}
	inst := *mc.rec.Instance
	link := mc.link
	mc.rec.State = registry.StateStopping
	r := mc.rec
	mc.mu.Unlock()
	if err := m.cfg.Registry.Put(&r); err != nil {
		return registry.Record{}, err
	}
	log := m.log.With("vm", r.Name)
	if !force && link != nil {
		sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := link.Shutdown(sctx, false)
		cancel()
		if err != nil {
			log.Warn("guest did not accept shutdown; killing", "err", err)
		} else {
			wctx, cancel := context.WithTimeout(ctx, m.cfg.StopTimeout)
			err = m.cfg.Driver.Wait(wctx, inst)
			cancel()
			if err != nil {
				log.Warn("guest did not power off in time; killing", "timeout", m.cfg.StopTimeout)
			}
		}
	}
	// Kill is a no-op when QEMU has already exited.
	if err := m.cfg.Driver.Kill(context.Background(), inst); err != nil {
		return registry.Record{}, fmt.Errorf("stop vm %q: %w", r.Name, err)
	}
	m.markStopped(mc, "")
	log.Info("vm stopped", "force", force)
	return mc.snapshot(), nil
}

// Delete removes a VM and all its state. A running VM must be stopped
// first, unless force is set.
func (m *Manager) Delete(ctx context.Context, name string, force bool) error {
	mc, err := m.get(name)
	if err != nil {
		return err
	}
	if err := lock(ctx, mc); err != nil {
		return err
	}
	defer mc.op.Unlock()
	if st := mc.snapshot().State; st != registry.StateStopped {
		if !force {
			return fmt.Errorf("%w: stop %q first, or delete with --force", ErrRunning, name)
		}
		if _, err := m.stopLocked(ctx, mc, true); err != nil {
			return err
		}
	}
	if err := m.cfg.Registry.Delete(name); err != nil {
		return err
	}
	m.forget(name)
	m.log.Info("vm deleted", "vm", name)
	return nil
}

// Exec starts a command in a running VM.
func (m *Manager) Exec(ctx context.Context, name string, req *agentv1.ExecRequest) (*agentlink.ExecStream, error) {
	mc, err := m.get(name)
	if err != nil {
		return nil, err
	}
	mc.mu.Lock()
	link, state := mc.link, mc.rec.State
	mc.mu.Unlock()
	if state != registry.StateRunning || link == nil {
		return nil, fmt.Errorf("%w: %q is %s", ErrNotRunning, name, state)
	}
	return link.Exec(ctx, req)
}

// Close detaches from every VM without stopping them: VMs outlive carreld
// and are re-adopted by the next one.
func (m *Manager) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, mc := range m.vms {
		mc.detach()
	}
	return nil
}

// Reconcile loads the registry after a start. Running VMs whose QEMU is
// still ours are adopted (never started twice); those that died meanwhile
// are marked stopped; half-created ones are killed and removed.
func (m *Manager) Reconcile(ctx context.Context) error {
	recs, err := m.cfg.Registry.List()
	var errs []error
	if err != nil {
		errs = append(errs, err)
	}
	for _, rec := range recs {
		if err := m.reconcileOne(ctx, rec); err != nil {
			errs = append(errs, fmt.Errorf("reconcile %q: %w", rec.Name, err))
		}
	}
	return errors.Join(errs...)
}

func (m *Manager) reconcileOne(ctx context.Context, rec *registry.Record) error {
	log := m.log.With("vm", rec.Name)
	if rec.State == registry.StateCreating {
		if rec.Instance != nil {
			_ = m.cfg.Driver.Kill(ctx, *rec.Instance)
		}
		log.Warn("removing vm whose create was interrupted")
		return m.cfg.Registry.Delete(rec.Name)
	}
	mc := &machine{rec: *rec}
	m.mu.Lock()
	m.vms[rec.Name] = mc
	m.mu.Unlock()
	if rec.State == registry.StateStopped || rec.Instance == nil {
		if rec.State != registry.StateStopped {
			m.markStopped(mc, "no instance recorded")
		}
		return nil
	}
	inst := *rec.Instance
	if err := m.cfg.Driver.Adopt(ctx, inst); err != nil {
		log.Warn("vm is gone; marking it stopped", "err", err)
		_ = m.cfg.Driver.Kill(ctx, inst)
		m.markStopped(mc, "vm exited while carreld was down")
		return nil
	}
	if rec.State == registry.StateStopping {
		// A stop was under way when carreld went down: finish it.
		mc.op.Lock()
		defer mc.op.Unlock()
		mc.rec.State = registry.StateRunning
		_, err := m.stopLocked(ctx, mc, true)
		return err
	}
	live, cancel := context.WithCancel(context.Background())
	rc, err := consoleRecord(live, m, inst, rec.Name)
	if err != nil {
		log.Warn("console not attached", "err", err)
	}
	dial, transport := m.cfg.Driver.AgentDialer(inst)
	link := agentlink.New(dial, m.cfg.Logger.With("vm", rec.Name, "transport", transport))
	mc.mu.Lock()
	mc.link, mc.console, mc.cancel = link, rc, cancel
	mc.mu.Unlock()
	exited := make(chan error, 1)
	go func() { exited <- m.cfg.Driver.Wait(live, inst) }()
	go func() {
		rctx, rcancel := context.WithTimeout(live, 30*time.Second)
		defer rcancel()
		if err := link.WaitReady(rctx); err != nil && live.Err() == nil {
			log.Warn("adopted vm's agent is not answering", "err", err)
		}
	}()
	m.watch(live, mc, inst, exited)
	log.Info("adopted running vm", "pid", inst.PID)
	return nil
}
