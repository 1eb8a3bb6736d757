package vm

import (
	"context"
	"fmt"
	"time"

	"github.com/carrel-os/carrel/supervisor/registry"
)

// Pause stops a running VM's vCPUs at an operator's request. Its memory,
// devices and disks are kept as they are; it stays paused, across carreld
// restarts too, until Resume. Calls into a paused guest are refused with
// ErrPaused instead of being left to time out; calls in flight wait, and
// fail with agentlink.ErrHeld if the pause outlasts their connection (see
// holdLink). Pausing a paused VM returns it unchanged.
func (m *Manager) Pause(ctx context.Context, name string) (registry.Record, error) {
	var rec registry.Record
	err := m.locked(ctx, name, func(mc *machine) error {
		r := mc.snapshot()
		if r.State != registry.StateRunning || r.Instance == nil {
			return fmt.Errorf("%w: %q is %s", ErrNotRunning, name, r.State)
		}
		if !r.Paused {
			// The record first: a carreld that dies before the VM is paused
			// finds it running against its record and pauses it
			// (reconcileOne).
			if err := m.persist(mc, func(r *registry.Record) { r.Paused, r.PausedAt = true, time.Now().UTC() }); err != nil {
				return err
			}
			if err := m.setVCPUs(ctx, mc, false); err != nil {
				perr := m.persist(mc, func(r *registry.Record) { r.Paused, r.PausedAt = false, time.Time{} })
				return fmt.Errorf("pause vm %q: %w", name, joinErr(err, perr))
			}
			m.holdLink(ctx, mc)
			_ = m.event(ctx, mc, EventPaused, "paused by request")
			m.log.Info("vm paused", "vm", name)
		}
		rec = mc.snapshot()
		return nil
	})
	return rec, err
}

// Resume starts the vCPUs of a VM that Pause stopped. Resuming a VM that
// is not paused returns it unchanged. A VM that carreld also holds paused
// (its audit log cannot be written: PauseAll) stays so until the hold
// ends.
func (m *Manager) Resume(ctx context.Context, name string) (registry.Record, error) {
	var rec registry.Record
	err := m.locked(ctx, name, func(mc *machine) error {
		r := mc.snapshot()
		if r.State != registry.StateRunning || r.Instance == nil {
			return fmt.Errorf("%w: %q is %s", ErrNotRunning, name, r.State)
		}
		if r.Paused {
			if err := m.persist(mc, func(r *registry.Record) { r.Paused, r.PausedAt = false, time.Time{} }); err != nil {
				return err
			}
			if err := m.setVCPUs(ctx, mc, true); err != nil {
				perr := m.persist(mc, func(rr *registry.Record) { rr.Paused, rr.PausedAt = true, r.PausedAt })
				return fmt.Errorf("resume vm %q: %w", name, joinErr(err, perr))
			}
			m.holdLink(ctx, mc)
			_ = m.event(ctx, mc, EventResumed, "resumed by request after "+time.Since(r.PausedAt).Round(time.Millisecond).String())
			m.log.Info("vm resumed", "vm", name)
		}
		rec = mc.snapshot()
		return nil
	})
	return rec, err
}

// setVCPUs starts or stops mc's vCPUs, unless carreld's hold (PauseAll)
// keeps them stopped: then ResumeAll decides, by the record.
func (m *Manager) setVCPUs(ctx context.Context, mc *machine, run bool) error {
	mc.mu.Lock()
	held, inst := mc.paused, mc.rec.Instance
	mc.mu.Unlock()
	if held || inst == nil {
		return nil
	}
	if run {
		return m.cfg.Driver.Resume(ctx, *inst)
	}
	return m.cfg.Driver.Pause(ctx, *inst)
}

func joinErr(err, also error) error {
	if also == nil {
		return err
	}
	return fmt.Errorf("%w (and its record could not be restored: %v)", err, also)
}
