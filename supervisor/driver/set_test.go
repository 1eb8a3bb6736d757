package driver_test

import (
	"context"
	"errors"
	"os"
	"testing"

	"github.com/carrel-os/carrel/supervisor/driver"
	"github.com/carrel-os/carrel/supervisor/driver/drivertest"
)

// named is a fake driver under another name, so that a Set can hold two.
type named struct {
	*drivertest.Driver
	name string
}

func (n named) Name() string { return n.name }

func (n named) Start(ctx context.Context, spec driver.Spec) (driver.Instance, error) {
	inst, err := n.Driver.Start(ctx, spec)
	inst.Driver = n.name
	return inst, err
}

func TestSetKeepsEachVMOnItsDriver(t *testing.T) {
	ctx := context.Background()
	q := named{drivertest.New(), "qemu"}
	l := named{drivertest.New(), "libvirt"}
	s := driver.NewSet(l, q)
	if s.Name() != "libvirt" || s.Default().Name() != "libvirt" {
		t.Fatalf("default: %s", s.Name())
	}

	// A VM recorded with the qemu driver starts there, not on the default.
	old, err := s.Start(ctx, driver.Spec{Name: "old", Dir: "/d/old", Driver: "qemu"})
	if err != nil {
		t.Fatal(err)
	}
	fresh, err := s.Start(ctx, driver.Spec{Name: "fresh", Dir: "/d/fresh"})
	if err != nil {
		t.Fatal(err)
	}
	if old.Driver != "qemu" || fresh.Driver != "libvirt" || q.Running() != 1 || l.Running() != 1 {
		t.Fatalf("old on %q, fresh on %q; qemu runs %d, libvirt %d", old.Driver, fresh.Driver, q.Running(), l.Running())
	}
	for _, inst := range []driver.Instance{old, fresh} {
		if err := s.Resume(ctx, inst); err != nil {
			t.Errorf("resume %s: %v", inst.Driver, err)
		}
		if _, err := s.Adopt(ctx, inst); err != nil {
			t.Errorf("adopt %s: %v", inst.Driver, err)
		}
	}
	if err := s.Kill(ctx, old); err != nil {
		t.Fatal(err)
	}
	if q.Running() != 0 || l.Running() != 1 {
		t.Errorf("after killing the qemu vm: qemu runs %d, libvirt %d", q.Running(), l.Running())
	}
	if err := s.Wait(ctx, old); err != nil {
		t.Errorf("wait on the killed vm: %v", err)
	}
	// Sweep asks every member: the libvirt one ends what it left in /d/fresh.
	if err := s.Sweep(ctx, "/d/fresh"); err != nil {
		t.Fatal(err)
	}
	if l.Running() != 0 {
		t.Errorf("sweep left %d libvirt vms", l.Running())
	}

	bad := driver.Instance{Driver: "xen"}
	if err := s.Kill(ctx, bad); !errors.Is(err, driver.ErrUnknownDriver) {
		t.Errorf("kill on an unknown driver: %v", err)
	}
	if _, err := s.Start(ctx, driver.Spec{Driver: "xen"}); !errors.Is(err, driver.ErrUnknownDriver) {
		t.Errorf("start on an unknown driver: %v", err)
	}
	dial, _ := s.AgentDialer(bad)
	if _, err := dial(ctx); !errors.Is(err, driver.ErrUnknownDriver) {
		t.Errorf("dial on an unknown driver: %v", err)
	}
	if _, err := s.ConsoleDialer(bad)(ctx); !errors.Is(err, driver.ErrUnknownDriver) {
		t.Errorf("console on an unknown driver: %v", err)
	}
}

// plain is a driver that cannot snapshot: it hides the fake's Snapshotter.
type plain struct{ driver.Driver }

func TestSetSnapshotsOnlyWhereTheDriverCan(t *testing.T) {
	q := named{drivertest.New(), "qemu"}
	l := plain{named{drivertest.New(), "libvirt"}}
	s := driver.NewSet(q, l)
	if _, err := driver.SnapshotterFor(s, "qemu"); err != nil {
		t.Errorf("qemu: %v", err)
	}
	if _, err := driver.SnapshotterFor(s, "libvirt"); !errors.Is(err, driver.ErrUnsupported) {
		t.Errorf("libvirt: %v", err)
	}
	if _, err := driver.SnapshotterFor(l, "libvirt"); !errors.Is(err, driver.ErrUnsupported) {
		t.Errorf("a lone driver that cannot: %v", err)
	}
	f, err := os.CreateTemp(t.TempDir(), "state")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := s.Start(context.Background(), driver.Spec{Name: "x", Driver: "libvirt", Incoming: f}); !errors.Is(err, driver.ErrUnsupported) {
		t.Errorf("a start from a saved state on a driver that cannot: %v", err)
	}
}
