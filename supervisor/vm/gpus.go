package vm

import (
	"context"
	"fmt"
)

// checkGPUsLocked vets a create's GPUs against the host and against every
// other VM's, with m.mu held so that no other create claims them
// meanwhile. A VM holds its GPUs from create to delete, running or not.
func (m *Manager) checkGPUsLocked(want []string) error {
	if len(want) == 0 {
		return nil
	}
	if m.cfg.CheckGPUs == nil {
		return fmt.Errorf("%w: this carreld cannot pass GPUs through", ErrInvalid)
	}
	held := map[string][]string{}
	for name, o := range m.vms {
		o.mu.Lock()
		if len(o.rec.GPUs) > 0 {
			held[name] = o.rec.GPUs
		}
		o.mu.Unlock()
	}
	return m.cfg.CheckGPUs(want, held)
}

// gpusOnRecord records that a run is about to get its VM's GPUs; the boot
// stops if that cannot be recorded.
func (m *Manager) gpusOnRecord(ctx context.Context, mc *machine) error {
	if len(mc.snapshot().GPUs) == 0 {
		return nil
	}
	if err := m.event(ctx, mc, EventGPUAttach, ""); err != nil {
		return err
	}
	mc.mu.Lock()
	mc.gpusOn = true
	mc.mu.Unlock()
	return nil
}

// gpusOff records that a run which had the VM's GPUs has ended: its QEMU
// is gone, and the driver has given the devices back.
func (m *Manager) gpusOff(ctx context.Context, mc *machine, reason string) {
	mc.mu.Lock()
	on := mc.gpusOn
	mc.gpusOn = false
	mc.mu.Unlock()
	if on {
		_ = m.event(ctx, mc, EventGPUDetach, reason)
	}
}
