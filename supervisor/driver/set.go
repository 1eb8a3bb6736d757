package driver

import (
	"context"
	"errors"
	"fmt"
	"net"
)

// ErrUnknownDriver means a VM names a driver this carreld does not have.
var ErrUnknownDriver = errors.New("unknown driver")

// Set is a Driver made of several: a VM keeps the driver it was created
// with, whatever the default is now. Start picks by Spec.Driver, the other
// calls by Instance.Driver (both "" for the default), and Sweep asks every
// member, since a directory does not say which driver last used it.
type Set struct {
	def     Driver
	members map[string]Driver
}

var _ Driver = (*Set)(nil)

// NewSet returns a Set whose new VMs get def. Members are named by their
// Name; def is a member too.
func NewSet(def Driver, others ...Driver) *Set {
	s := &Set{def: def, members: map[string]Driver{def.Name(): def}}
	for _, d := range others {
		s.members[d.Name()] = d
	}
	return s
}

// Default is the driver new VMs get.
func (s *Set) Default() Driver { return s.def }

// Name is the default driver's name: Create records it for new VMs.
func (s *Set) Name() string { return s.def.Name() }

func (s *Set) pick(name string) (Driver, error) {
	if name == "" {
		return s.def, nil
	}
	d, ok := s.members[name]
	if !ok {
		return nil, fmt.Errorf("%w %q", ErrUnknownDriver, name)
	}
	return d, nil
}

// Start implements Lifecycle.
func (s *Set) Start(ctx context.Context, spec Spec) (Instance, error) {
	d, err := s.pick(spec.Driver)
	if err != nil {
		return Instance{}, err
	}
	if _, ok := d.(Snapshotter); spec.Incoming != nil && !ok {
		return Instance{}, fmt.Errorf("the %s driver cannot start a vm from a saved state: %w", d.Name(), ErrUnsupported)
	}
	return d.Start(ctx, spec)
}

var _ Snapshotter = (*Set)(nil)

// SnapshotterFor returns what snapshots VMs of the named driver in d (a
// Set, or a single driver), or an error wrapping ErrUnsupported, so that a
// caller can ask before it changes anything.
func SnapshotterFor(d Driver, name string) (Snapshotter, error) {
	if s, ok := d.(*Set); ok {
		return s.snapshotter(name)
	}
	if sn, ok := d.(Snapshotter); ok {
		return sn, nil
	}
	return nil, fmt.Errorf("the %s driver cannot snapshot vms: %w", d.Name(), ErrUnsupported)
}

func (s *Set) snapshotter(name string) (Snapshotter, error) {
	d, err := s.pick(name)
	if err != nil {
		return nil, err
	}
	sn, ok := d.(Snapshotter)
	if !ok {
		return nil, fmt.Errorf("the %s driver cannot snapshot vms: %w", d.Name(), ErrUnsupported)
	}
	return sn, nil
}

// FreezeDisks implements Snapshotter, for members that do.
func (s *Set) FreezeDisks(ctx context.Context, inst Instance, overlays map[string]string) error {
	sn, err := s.snapshotter(inst.Driver)
	if err != nil {
		return err
	}
	return sn.FreezeDisks(ctx, inst, overlays)
}

// SaveState implements Snapshotter, for members that do.
func (s *Set) SaveState(ctx context.Context, inst Instance, path string, max int64) (int64, error) {
	sn, err := s.snapshotter(inst.Driver)
	if err != nil {
		return 0, err
	}
	return sn.SaveState(ctx, inst, path, max)
}

// OpenDiskFiles implements DiskFiles, for members that do; for the others
// it returns ErrUnsupported.
func (s *Set) OpenDiskFiles(ctx context.Context, inst Instance) ([]string, error) {
	d, err := s.pick(inst.Driver)
	if err != nil {
		return nil, err
	}
	df, ok := d.(DiskFiles)
	if !ok {
		return nil, ErrUnsupported
	}
	return df.OpenDiskFiles(ctx, inst)
}

// Resume implements Lifecycle.
func (s *Set) Resume(ctx context.Context, inst Instance) error {
	d, err := s.pick(inst.Driver)
	if err != nil {
		return err
	}
	return d.Resume(ctx, inst)
}

// Pause implements Lifecycle.
func (s *Set) Pause(ctx context.Context, inst Instance) error {
	d, err := s.pick(inst.Driver)
	if err != nil {
		return err
	}
	return d.Pause(ctx, inst)
}

// Adopt implements Lifecycle.
func (s *Set) Adopt(ctx context.Context, inst Instance) (bool, error) {
	d, err := s.pick(inst.Driver)
	if err != nil {
		return false, err
	}
	return d.Adopt(ctx, inst)
}

// Wait implements Lifecycle.
func (s *Set) Wait(ctx context.Context, inst Instance) error {
	d, err := s.pick(inst.Driver)
	if err != nil {
		return err
	}
	return d.Wait(ctx, inst)
}

// Kill implements Lifecycle.
func (s *Set) Kill(ctx context.Context, inst Instance) error {
	d, err := s.pick(inst.Driver)
	if err != nil {
		return err
	}
	return d.Kill(ctx, inst)
}

// Sweep implements Lifecycle: every member sweeps dir.
func (s *Set) Sweep(ctx context.Context, dir string) error {
	var errs []error
	for name, d := range s.members {
		if err := d.Sweep(ctx, dir); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", name, err))
		}
	}
	return errors.Join(errs...)
}

// AgentDialer implements Streams. For an unknown driver the dialer fails.
func (s *Set) AgentDialer(inst Instance) (Dialer, string) {
	d, err := s.pick(inst.Driver)
	if err != nil {
		return failDialer(err), ""
	}
	return d.AgentDialer(inst)
}

// ConsoleDialer implements Streams. For an unknown driver the dialer fails.
func (s *Set) ConsoleDialer(inst Instance) Dialer {
	d, err := s.pick(inst.Driver)
	if err != nil {
		return failDialer(err)
	}
	return d.ConsoleDialer(inst)
}

func failDialer(err error) Dialer {
	return func(context.Context) (net.Conn, error) { return nil, err }
}
