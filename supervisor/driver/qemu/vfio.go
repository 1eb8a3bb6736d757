package qemu

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"

	"github.com/carrel-os/carrel/supervisor/atomicfile"
	"github.com/carrel-os/carrel/supervisor/driver"
	"github.com/carrel-os/carrel/supervisor/gpu"
)

// gpuPlan is what a VM's GPUs add to its QEMU.
type gpuPlan struct {
	moved  []gpu.Address // devices Bind moved to vfio-pci for this VM
	groups []int         // their IOMMU groups
	args   []string
}

// machine is the machine type a VM gets: GPUs need a PCI bus, which only
// q35 has, so a VM with GPUs gets q35 whatever the default.
func (p gpuPlan) machine(def string) string {
	if len(p.args) > 0 {
		return MachineQ35
	}
	return def
}

// bindGPUs vets the VM's GPUs again, since the host may have changed since
// the VM was created (rebooted without the IOMMU, a card moved), binds
// every device that goes to the VM to vfio-pci, as libvirt does for a
// managed hostdev, and returns QEMU's arguments for them.
//
// Before it moves anything, it writes the devices it may move to the VM's
// directory (l.vfio), and after, the ones it did: a carreld that dies
// before the VM's record has them finds them there at its next start
// (Sweep), and gives them back.
func (d *Driver) bindGPUs(spec driver.Spec, l layout) (gpuPlan, error) {
	if len(spec.GPUs) == 0 {
		return gpuPlan{}, nil
	}
	p, err := d.cfg.GPUs.Check(spec.GPUs, nil)
	if err != nil {
		return gpuPlan{}, fmt.Errorf("vm %q: %w", spec.Name, err)
	}
	devs := p.Addresses()
	movable, err := d.cfg.GPUs.Movable(devs)
	if err == nil {
		err = writeMoved(l.vfio, movable)
	}
	if err != nil {
		return gpuPlan{}, fmt.Errorf("vm %q: record its gpus before binding them: %w", spec.Name, err)
	}
	moved, err := d.cfg.GPUs.Bind(devs)
	if err == nil {
		err = writeMoved(l.vfio, moved)
	}
	if err != nil {
		return gpuPlan{}, fmt.Errorf("vm %q: %w", spec.Name, err)
	}
	d.cfg.Logger.Info("gpus bound to vfio-pci", "vm", spec.Name, "devices", gpu.Strings(devs), "moved", gpu.Strings(moved))
	var groups []int
	for _, dev := range p.Devices {
		if dev.IOMMUGroup >= 0 && !slices.Contains(groups, dev.IOMMUGroup) {
			groups = append(groups, dev.IOMMUGroup)
		}
	}
	return gpuPlan{moved: moved, groups: groups, args: vfioArgs(devs)}, nil
}

// releaseGPUs gives the devices a VM's start moved to vfio-pci back to
// their host drivers, then forgets them (the file at path). Its QEMU must
// be gone.
func (d *Driver) releaseGPUs(devs []string, path string) error {
	if len(devs) > 0 {
		as, err := gpu.ParseAddresses(devs)
		if err != nil {
			return err
		}
		if err := d.cfg.GPUs.Release(as); err != nil {
			return err
		}
		d.cfg.Logger.Info("gpus given back to the host", "devices", devs)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// writeMoved records devs as the devices a start moved (or may move) to
// vfio-pci, one a line; none removes the record.
func writeMoved(path string, devs []gpu.Address) error {
	if len(devs) == 0 {
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
		return nil
	}
	return atomicfile.WriteFile(path, []byte(strings.Join(gpu.Strings(devs), "\n")+"\n"), 0o600)
}

// readMoved reads what writeMoved wrote; nil when there is nothing.
func readMoved(path string) ([]string, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	devs := strings.Fields(string(b))
	if _, err := gpu.ParseAddresses(devs); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return devs, nil
}

// vfioArgs passes devs (sorted, as a gpu.Plan has them) through to the
// guest with vfio-pci. Each host slot gets a PCIe root port of its own,
// and its functions keep their order on it, the first marked
// multifunction when there are several: a GPU and its HDMI audio appear
// to the guest as one device, as on the host.
func vfioArgs(devs []gpu.Address) []string {
	var a []string
	port, fn := -1, 0
	for i, dev := range devs {
		if i == 0 || !dev.SameSlot(devs[i-1]) {
			port++
			fn = 0
			a = append(a, "-device", fmt.Sprintf("pcie-root-port,id=carrel-rp%d,bus=pcie.0,chassis=%d", port, port+1))
		}
		opt := fmt.Sprintf("vfio-pci,host=%s,id=carrel-hostdev%d,bus=carrel-rp%d,addr=00.%d", dev, i, port, fn)
		if fn == 0 && i+1 < len(devs) && devs[i+1].SameSlot(dev) {
			opt += ",multifunction=on"
		}
		a = append(a, "-device", opt)
		fn++
	}
	return a
}
