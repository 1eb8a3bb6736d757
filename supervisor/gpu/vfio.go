package gpu

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// Bind makes sure every device is bound to vfio-pci, as libvirt does for a
// hostdev with managed='yes' (virPCIDeviceBindToStub): for each device on
// another driver it writes "vfio-pci" to driver_override, unbinds the
// device from its driver, and asks the kernel to probe it again
// (bus/pci/drivers_probe), which, with the override set, binds vfio-pci
// alone. A device already on vfio-pci is left as it is.
//
// It returns the devices it moved, for Release. On error it releases what
// it moved and returns nil.
func (h *Host) Bind(devs []Address) (moved []Address, err error) {
	if _, err := os.Stat(h.driverDir(VFIODriver)); err != nil {
		return nil, fmt.Errorf("%w: the vfio-pci driver is not loaded (modprobe vfio-pci): %w", ErrUnavailable, err)
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, h.Release(moved))
			moved = nil
		}
	}()
	for _, a := range devs {
		cur, err := linkBase(filepath.Join(h.pciDir(a), "driver"))
		if err != nil {
			return moved, err
		}
		if cur == VFIODriver {
			continue
		}
		// From the first write on, the device is ours to give back.
		moved = append(moved, a)
		if err := h.write(filepath.Join(h.pciDir(a), "driver_override"), []byte(VFIODriver)); err != nil {
			return moved, fmt.Errorf("%w: set driver_override of %s: %w", ErrUnavailable, a, err)
		}
		if cur != "" {
			if err := h.write(filepath.Join(h.driverDir(cur), "unbind"), []byte(a.String())); err != nil {
				return moved, fmt.Errorf("%w: unbind %s from %s (is the host still using it?): %w", ErrUnavailable, a, cur, err)
			}
		}
		if err := h.probe(a); err != nil {
			return moved, err
		}
		now, err := linkBase(filepath.Join(h.pciDir(a), "driver"))
		if err != nil {
			return moved, err
		}
		if now != VFIODriver {
			return moved, fmt.Errorf("%w: %s did not bind to vfio-pci (its driver is now %q)", ErrUnavailable, a, now)
		}
	}
	return moved, nil
}

// Movable returns the devices of devs that Bind would move: those not on
// vfio-pci now.
func (h *Host) Movable(devs []Address) ([]Address, error) {
	var out []Address
	for _, a := range devs {
		cur, err := linkBase(filepath.Join(h.pciDir(a), "driver"))
		if err != nil {
			return nil, err
		}
		if cur != VFIODriver {
			out = append(out, a)
		}
	}
	return out, nil
}

// Release gives devices Bind moved back to the host, as libvirt does when
// a managed hostdev's domain ends (virPCIDeviceUnbindFromStub): it unbinds
// each from vfio-pci, clears the driver_override Bind set, and has the
// kernel probe it, so that its own driver takes it again. A device that
// has left vfio-pci meanwhile, or whose override someone changed, keeps
// what it has. Every device is tried; the errors are joined.
func (h *Host) Release(devs []Address) error {
	var errs []error
	for _, a := range devs {
		if err := h.release(a); err != nil {
			errs = append(errs, fmt.Errorf("give %s back to the host: %w", a, err))
		}
	}
	return errors.Join(errs...)
}

func (h *Host) release(a Address) error {
	dir := h.pciDir(a)
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		return nil // removed from the host
	}
	cur, err := linkBase(filepath.Join(dir, "driver"))
	if err != nil {
		return err
	}
	if cur == VFIODriver {
		if err := h.write(filepath.Join(h.driverDir(VFIODriver), "unbind"), []byte(a.String())); err != nil {
			return err
		}
		cur = ""
	}
	ovr, err := os.ReadFile(filepath.Join(dir, "driver_override"))
	if err != nil {
		return err
	}
	if strings.TrimSpace(string(ovr)) == VFIODriver {
		// A lone newline clears the override.
		if err := h.write(filepath.Join(dir, "driver_override"), []byte("\n")); err != nil {
			return err
		}
	}
	if cur != "" {
		return nil // someone else's now
	}
	return h.probe(a)
}

func (h *Host) probe(a Address) error {
	if err := h.write(filepath.Join(h.root, "bus", "pci", "drivers_probe"), []byte(a.String())); err != nil {
		return fmt.Errorf("%w: probe %s: %w", ErrUnavailable, a, err)
	}
	return nil
}

func (h *Host) driverDir(name string) string {
	return filepath.Join(h.root, "bus", "pci", "drivers", name)
}

// Strings returns the addresses in the kernel's spelling.
func Strings(as []Address) []string {
	out := make([]string, len(as))
	for i, a := range as {
		out[i] = a.String()
	}
	return out
}
