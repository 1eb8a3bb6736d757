package drivertest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/supervisor/driver"
)

var _ driver.Snapshotter = (*Driver)(nil)

// SnapshotFaults script the fake's snapshots.
type SnapshotFaults struct {
	// FreezeErr fails FreezeDisks before it makes anything; SaveErr fails
	// SaveState after part of the state is written.
	FreezeErr, SaveErr error
	// OverlaysOnly makes FreezeDisks make the overlays and return, the
	// disks not moved, as a libvirt driver cut short between the two.
	OverlaysOnly bool
}

// SetSnapshotFaults scripts the snapshots that follow.
func (d *Driver) SetSnapshotFaults(f SnapshotFaults) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.faults = f
}

// FreezeDisks implements driver.Snapshotter: each overlay is a real qcow2
// file over the current one, made with qemu-img, as QEMU would make it.
func (d *Driver) FreezeDisks(ctx context.Context, inst driver.Instance, overlays map[string]string) error {
	v, err := d.vm(inst)
	if err != nil {
		return err
	}
	d.mu.Lock()
	ferr, only := d.faults.FreezeErr, d.faults.OverlaysOnly
	d.mu.Unlock()
	if ferr != nil {
		return ferr
	}
	if !v.Paused() {
		return errors.New("fake: freezing the disks of a running vm")
	}
	for cur, next := range overlays {
		out, err := exec.CommandContext(ctx, "qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-u", "-b", cur, next, "64M").CombinedOutput()
		if err != nil {
			return fmt.Errorf("fake: qemu-img: %v: %s", err, out)
		}
	}
	if only {
		return nil
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	for i, f := range v.open {
		if next, ok := overlays[f]; ok {
			v.open[i] = next
		}
	}
	return nil
}

var _ driver.DiskFiles = (*Driver)(nil)

// OpenDiskFiles implements driver.DiskFiles: the disks of the VM's spec,
// moved by FreezeDisks.
func (d *Driver) OpenDiskFiles(ctx context.Context, inst driver.Instance) ([]string, error) {
	v, err := d.vm(inst)
	if err != nil {
		return nil, err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	return slices.Clone(v.open), nil
}

// SaveState implements driver.Snapshotter: the state is the VM's pid,
// repeated, so that a start from it can tell whose it was (VM.From).
func (d *Driver) SaveState(ctx context.Context, inst driver.Instance, path string, max int64) (int64, error) {
	v, err := d.vm(inst)
	if err != nil {
		return 0, err
	}
	if !v.Paused() {
		return 0, errors.New("fake: saving the state of a running vm")
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o400)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	w := driver.LimitWriter(f, max)
	d.mu.Lock()
	serr := d.faults.SaveErr
	d.mu.Unlock()
	var n int64
	for i := 0; i < 1000; i++ {
		m, err := fmt.Fprintf(w, "fake vm %d\n", inst.PID)
		n += int64(m)
		if err != nil {
			return n, err
		}
		if serr != nil && i == 500 {
			return n, serr
		}
	}
	return n, f.Close()
}

// From returns the saved state the VM started from (Spec.Incoming), read
// whole by Start; nil for a VM that booted.
func (v *VM) From() []byte { return v.from }

// readIncoming reads a Spec.Incoming at Start, from its beginning, as QEMU
// reads its own descriptor.
func readIncoming(f *os.File) ([]byte, error) {
	if f == nil {
		return nil, nil
	}
	return io.ReadAll(io.NewSectionReader(f, 0, 1<<30))
}

// Restored answers as an agent that reseeded, set its clock and, for a
// fork, took the machine id (VM.Restored).
func (a *agent) Restored(_ context.Context, req *connect.Request[agentv1.RestoredRequest]) (*connect.Response[agentv1.RestoredResponse], error) {
	a.vm.mu.Lock()
	a.vm.restored = append(a.vm.restored, req.Msg)
	a.vm.mu.Unlock()
	if d := a.vm.behavior.NotReseeded; d != "" {
		return connect.NewResponse(&agentv1.RestoredResponse{ClockSet: true, Detail: d}), nil
	}
	return connect.NewResponse(&agentv1.RestoredResponse{Reseeded: true, ClockSet: true, MachineIdSet: req.Msg.MachineId != ""}), nil
}

// Restored returns what carreld told the VM's agent with Restored calls.
func (v *VM) Restored() []*agentv1.RestoredRequest {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.restored
}
