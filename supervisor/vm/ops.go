package vm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/agentlink"
	"github.com/carrel-os/carrel/supervisor/driver"
	"github.com/carrel-os/carrel/supervisor/registry"
)

// Status is a VM's record plus its live agent state.
type Status struct {
	registry.Record
	Agent agentlink.State
	// Transport is how the host reaches the agent ("vsock" or
	// "virtio-serial"), as the host chose it, not as the guest claims.
	Transport string
	// DataPort is whether file content goes on the data port
	// (agentlink.Link.DataPortInUse).
	DataPort bool
	// Held is set while PauseAll holds the VM paused (the audit log
	// cannot be written); Record.Paused is an operator's pause.
	Held bool
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
		st.Transport = mc.transport
		st.DataPort = mc.link.DataPortInUse()
	}
	st.Held = mc.paused
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
	slices.SortFunc(out, func(a, b Status) int { return strings.Compare(a.Name, b.Name) })
	return out
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

// Responsive reports whether the manager's own lock can be taken within
// timeout; the systemd watchdog uses it to tell a wedged carreld.
func (m *Manager) Responsive(timeout time.Duration) bool {
	done := make(chan struct{})
	go func() {
		m.mu.Lock()
		m.mu.Unlock()
		close(done)
	}()
	select {
	case <-done:
		return true
	case <-time.After(timeout):
		return false
	}
}

// locked runs fn with the VM's operation lock held, as a tracked
// operation.
func (m *Manager) locked(ctx context.Context, name string, fn func(mc *machine) error) error {
	end, err := m.begin()
	if err != nil {
		return err
	}
	defer end()
	mc, err := m.get(name)
	if err != nil {
		return err
	}
	if err := mc.lock(ctx); err != nil {
		return err
	}
	defer mc.unlock()
	return fn(mc)
}

// Start boots a stopped VM. Starting a running VM is an error.
func (m *Manager) Start(ctx context.Context, name string) (registry.Record, error) {
	var rec registry.Record
	err := m.locked(ctx, name, func(mc *machine) error {
		if st := mc.snapshot().State; st != registry.StateStopped {
			return fmt.Errorf("%w: %q is %s", ErrRunning, name, st)
		}
		if err := m.startLocked(ctx, mc); err != nil {
			return err
		}
		rec = mc.snapshot()
		return nil
	})
	return rec, err
}

// startLocked boots a stopped VM whose op lock is held.
func (m *Manager) startLocked(ctx context.Context, mc *machine) error {
	// Recorded before QEMU starts: if carreld dies mid-boot, reconcile
	// finds the VM in state starting and ends what was started.
	if err := m.persist(mc, func(r *registry.Record) { r.State = registry.StateStarting }); err != nil {
		return err
	}
	if err := m.boot(ctx, mc, nil); err != nil {
		m.markStopped(mc, EventFailed, err.Error())
		return err
	}
	return nil
}

// Stop powers a VM off: it asks the guest agent to shut down, waits up to
// the stop timeout, then kills QEMU. With force it kills at once. Stopping
// a stopped VM returns it unchanged.
func (m *Manager) Stop(ctx context.Context, name string, force bool) (registry.Record, error) {
	var rec registry.Record
	err := m.locked(ctx, name, func(mc *machine) error {
		if err := m.stopLocked(ctx, mc, force); err != nil {
			return err
		}
		rec = mc.snapshot()
		return nil
	})
	return rec, err
}

func (m *Manager) stopLocked(ctx context.Context, mc *machine, force bool) error {
	rec := mc.snapshot()
	if rec.State == registry.StateStopped || rec.Instance == nil {
		return nil
	}
	inst := *rec.Instance
	if err := m.persist(mc, func(r *registry.Record) { r.State = registry.StateStopping }); err != nil {
		return err
	}
	how := "power off"
	if force {
		how = "kill"
	}
	_ = m.event(ctx, mc, EventStopping, how)
	mc.mu.Lock()
	link := mc.link
	mc.mu.Unlock()
	log := m.log.With("vm", rec.Name)
	if rec.Paused && !force {
		// Its guest must run to power off cleanly (and sync its disks).
		if err := m.setVCPUs(ctx, mc, true); err != nil {
			log.Warn("paused vm could not be resumed to power off; killing", "err", err)
			force = true
		} else {
			// Stopping, it is no longer held for its pause, unless
			// carreld holds it too (then its vCPUs did not start).
			m.holdLink(ctx, mc)
		}
	}
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
		return fmt.Errorf("stop vm %q: %w", rec.Name, err)
	}
	m.markStopped(mc, EventStopped, "")
	log.Info("vm stopped", "force", force)
	return nil
}

// Reset discards what the VM changed outside /workspace (its writable
// layer over the verified image) and, with workspace, its /workspace too,
// so that its next boot is the image as built. A running VM is stopped
// first and booted again after, in a new session; a stopped VM stays
// stopped.
func (m *Manager) Reset(ctx context.Context, name string, workspace bool) (registry.Record, error) {
	var rec registry.Record
	err := m.locked(ctx, name, func(mc *machine) error {
		wasRunning := mc.snapshot().State != registry.StateStopped
		if err := m.stopLocked(ctx, mc, false); err != nil {
			return err
		}
		serials := []string{protocol.StateSerial}
		what := "writable layer"
		if workspace {
			serials = writableSerials
			what = "writable layer and workspace"
		}
		// Recorded first: nothing is discarded unless the log says so.
		if err := m.event(ctx, mc, EventReset, what+" discarded"); err != nil {
			return err
		}
		// The VM's current files are its own, never a snapshot's, but
		// their names may be older files that snapshots keep: the next
		// boot makes new files under new names.
		cur := mc.snapshot()
		dir := m.cfg.Registry.Dir(name)
		fresh := map[string]string{}
		for serial, n := range cur.Disks {
			fresh[serial] = n
		}
		for _, serial := range serials {
			if err := os.Remove(filepath.Join(dir, diskName(cur, serial))); err != nil && !errors.Is(err, os.ErrNotExist) {
				return fmt.Errorf("reset vm %q: %w", name, err)
			}
			fresh[serial] = newDiskName(serial)
		}
		if err := m.persist(mc, func(r *registry.Record) { r.Disks, r.Origin = fresh, nil }); err != nil {
			return err
		}
		m.collect(name)
		m.log.Info("vm reset", "vm", name, "discarded", what)
		if wasRunning {
			if err := m.startLocked(ctx, mc); err != nil {
				return err
			}
		}
		rec = mc.snapshot()
		return nil
	})
	return rec, err
}

// Delete removes a VM and all its state. A running VM must be stopped
// first, unless force is set.
func (m *Manager) Delete(ctx context.Context, name string, force bool) error {
	return m.locked(ctx, name, func(mc *machine) error { return m.deleteLocked(ctx, mc, name, force) })
}

func (m *Manager) deleteLocked(ctx context.Context, mc *machine, name string, force bool) error {
	if deps := m.dependents(name); len(deps) > 0 {
		return fmt.Errorf("%w: %s stand on %q's disk layers (forked from its snapshots): delete them first", ErrRunning, strings.Join(deps, ", "), name)
	}
	if st := mc.snapshot().State; st != registry.StateStopped {
		if !force {
			return fmt.Errorf("%w: stop %q first, or delete with --force", ErrRunning, name)
		}
		if err := m.stopLocked(ctx, mc, true); err != nil {
			return err
		}
	}
	if err := m.cfg.Registry.Delete(name); err != nil {
		return err
	}
	mc.mu.Lock()
	mc.removed = true
	mc.mu.Unlock()
	m.forget(name)
	_ = m.event(ctx, mc, EventRemoved, "")
	if m.cfg.OnRemoved != nil {
		m.cfg.OnRemoved(name)
	}
	m.log.Info("vm deleted", "vm", name)
	return nil
}

// SetPolicy binds a VM to another policy. The record is written first and
// the live VM switches with it; a running guest then gets the new policy's
// sandbox (Config.Policies). If that fails the binding still
// stands (the host decides every call by it) and the error says so.
func (m *Manager) SetPolicy(ctx context.Context, name, policy string) error {
	if m.cfg.Policies != nil {
		if _, err := m.cfg.Policies.Get(policy); err != nil {
			return fmt.Errorf("%w: %w", ErrInvalid, err)
		}
	}
	return m.locked(ctx, name, func(mc *machine) error {
		if err := m.persist(mc, func(r *registry.Record) { r.Policy = policy }); err != nil {
			return err
		}
		m.log.Info("vm policy bound", "vm", name, "policy", policy)
		return m.ResyncSandbox(ctx, name)
	})
}

// ResyncSandbox gives a running VM's guest its policy's sandbox again,
// after the policy changed. A stopped VM gets it at its next boot.
func (m *Manager) ResyncSandbox(ctx context.Context, name string) error {
	mc, err := m.get(name)
	if err != nil {
		return err
	}
	mc.mu.Lock()
	rec, link := mc.rec, mc.link
	mc.mu.Unlock()
	if rec.State != registry.StateRunning || link == nil {
		return nil
	}
	if err := m.giveSandbox(ctx, rec, link); err != nil {
		return fmt.Errorf("vm %q: the host enforces its new policy, but the guest's sandbox was not updated: %w", name, err)
	}
	return nil
}

// PolicyOf returns the name of the policy bound to a VM.
func (m *Manager) PolicyOf(name string) (string, error) {
	mc, err := m.get(name)
	if err != nil {
		return "", err
	}
	mc.mu.Lock()
	defer mc.mu.Unlock()
	return mc.rec.PolicyName(), nil
}

// Link returns the agent link of a running VM.
func (m *Manager) Link(name string) (*agentlink.Link, error) {
	mc, err := m.get(name)
	if err != nil {
		return nil, err
	}
	mc.mu.Lock()
	link, state, paused := mc.link, mc.rec.State, mc.rec.Paused
	mc.mu.Unlock()
	if state != registry.StateRunning || link == nil {
		return nil, fmt.Errorf("%w: %q is %s", ErrNotRunning, name, state)
	}
	if paused {
		return nil, fmt.Errorf("%w: %q: resume it first (carrel vm resume %s)", ErrPaused, name, name)
	}
	return link, nil
}

// Close waits for lifecycle operations in flight (so none is cut off
// half-way), then detaches from every VM without stopping it: VMs outlive
// carreld and are re-adopted by the next one.
func (m *Manager) Close() error {
	m.mu.Lock()
	m.closing = true
	m.mu.Unlock()
	m.ops.Wait()
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, mc := range m.vms {
		mc.detach()
	}
	return nil
}

// Reconcile loads the registry after a start. Running VMs whose QEMU is
// still ours are adopted (never started twice); those that died meanwhile
// are marked stopped; whatever an interrupted create or start left running
// is killed.
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

// killLeftovers ends the QEMU of rec, if any, and whatever a Start in its
// directory left running.
func (m *Manager) killLeftovers(ctx context.Context, rec *registry.Record) error {
	var errs []error
	if rec.Instance != nil {
		errs = append(errs, m.cfg.Driver.Kill(ctx, *rec.Instance))
	}
	errs = append(errs, m.cfg.Driver.Sweep(ctx, m.cfg.Registry.Dir(rec.Name)))
	return errors.Join(errs...)
}

func (m *Manager) reconcileOne(ctx context.Context, rec *registry.Record) error {
	log := m.log.With("vm", rec.Name)
	m.reconcilePending(ctx, rec)
	switch {
	case rec.State == registry.StateCreating:
		log.Warn("removing vm whose create was interrupted")
		if err := m.killLeftovers(ctx, rec); err != nil {
			return err // keep the record: the next start tries again
		}
		if len(rec.GPUs) > 0 {
			// Its boot may have recorded their attach: the devices are the
			// host's again (killLeftovers gave back what the start bound),
			// and the log says so.
			mc := newMachine(*rec)
			mc.gpusOn = true
			m.gpusOff(ctx, mc, "create interrupted by a carreld restart")
		}
		return m.cfg.Registry.Delete(rec.Name)
	case rec.State == registry.StateStarting, rec.Instance == nil:
		mc := newMachine(*rec)
		m.register(mc)
		if rec.State == registry.StateStopped {
			return nil
		}
		log.Warn("stopping vm whose start was interrupted", "state", rec.State)
		if err := m.killLeftovers(ctx, rec); err != nil {
			return err
		}
		m.markStopped(mc, EventFailed, "start interrupted by a carreld restart")
		return nil
	}

	mc := newMachine(*rec)
	mc.cid = rec.Instance.CID
	m.register(mc)
	inst := *rec.Instance
	paused, err := m.cfg.Driver.Adopt(ctx, inst)
	if errors.Is(err, driver.ErrNotRunning) {
		log.Warn("vm exited while carreld was down; marking it stopped")
		// Kill ends nothing now, but the driver lets go of what the VM
		// held (its cgroup, its GPUs).
		if err := m.cfg.Driver.Kill(ctx, inst); err != nil {
			log.Error("releasing what the vm held", "err", err)
		}
		m.markStopped(mc, EventStopped, "vm exited while carreld was down")
		return nil
	}
	if err != nil {
		// The process is ours and alive, but QMP did not answer: keep the
		// VM (never start it twice) and let the agent link tell its health.
		log.Warn("adopting vm whose qmp does not answer", "err", err)
	} else if err := m.matchPause(ctx, rec, paused); err != nil {
		log.Error("adopted vm's vcpus do not match its record", "err", err)
	}
	if rec.State == registry.StateStopping {
		// A stop was under way when carreld went down: finish it.
		mc.op <- struct{}{}
		defer mc.unlock()
		return m.stopLocked(ctx, mc, true)
	}
	live, cancel := context.WithCancel(context.Background())
	rc, err := consoleRecord(live, m, inst, rec.Name)
	if err != nil {
		log.Warn("console not attached", "err", err)
	}
	dial, transport := m.cfg.Driver.AgentDialer(inst)
	link := agentlink.New(dial, m.cfg.Logger.With("vm", rec.Name, "transport", transport))
	link.UseDataPort(driver.DataDialer(inst))
	m.attach(live, cancel, mc, inst, link, rc, transport, m.watchExit(live, inst))
	go func() {
		rctx, rcancel := context.WithTimeout(live, 30*time.Second)
		defer rcancel()
		wait := link.WaitReady
		if paused && !rec.Paused {
			// It was resumed just now: its agent may not yet have seen the
			// previous carreld go, and read this one's first handshakes as
			// its old session's bytes, as after a restore.
			wait = func(ctx context.Context) error { return link.WaitReadyEvery(ctx, restoredAttempt) }
		}
		if err := wait(rctx); err != nil && live.Err() == nil {
			log.Warn("adopted vm's agent is not answering", "err", err)
			return
		}
		if err := m.giveSandbox(rctx, mc.snapshot(), link); err != nil && live.Err() == nil {
			log.Error("adopted vm's sandbox could not be set; its calls are still decided on the host", "err", err)
		}
	}()
	_ = m.event(ctx, mc, EventAdopted, "")
	log.Info("adopted running vm", "pid", inst.PID)
	return nil
}

// matchPause makes an adopted VM's vCPUs what its record says: stopped
// if an operator paused it, else running. A VM is found paused against its
// record when the carreld before held it (its audit log failed), or died
// between recording a resume and making it.
func (m *Manager) matchPause(ctx context.Context, rec *registry.Record, paused bool) error {
	switch {
	case paused && !rec.Paused:
		m.log.Info("resuming a vm a previous carreld left paused", "vm", rec.Name)
		return m.cfg.Driver.Resume(ctx, *rec.Instance)
	case !paused && rec.Paused:
		m.log.Info("pausing a vm its record says is paused", "vm", rec.Name)
		return m.cfg.Driver.Pause(ctx, *rec.Instance)
	}
	return nil
}

func (m *Manager) register(mc *machine) {
	m.mu.Lock()
	m.vms[mc.rec.Name] = mc
	m.mu.Unlock()
}
