// Package gpu finds the host's GPUs and hands them to VMs through VFIO.
//
// Everything it knows comes from sysfs, whose root is injectable so that
// tests run on a fake tree (package gputest): /sys/bus/pci/devices for
// the devices, their drivers and IOMMU groups, and /sys/kernel/iommu_groups
// for the groups' members. It lists display controllers (PCI base class
// 0x03: VGA 0x0300, 3D 0x0302, other 0x0380), decides whether each one's
// IOMMU group can be assigned whole, vets a VM's request, binds the
// devices to vfio-pci before a VM starts and gives them back after, as
// libvirt does for a managed hostdev, and builds libvirt's hostdev XML.
//
// The assignability rule follows the kernel's VFIO documentation and
// libvirt's: the IOMMU group is the unit of isolation, so every endpoint
// device of a group must go to the same VM. A GPU's group is assignable
// when each other member is either
//   - a function of the GPU's own slot (its HDMI audio, its USB-C
//     controller): it goes to the VM with the GPU; or
//   - a bridge, a device whose configuration header is type 1 (PCI-to-PCI)
//     or 2 (CardBus): it stays with the host, as VFIO allows.
//
// Any other member blocks the GPU, even one no driver uses now: handing
// the GPU over would leave that device behind, unisolated from the VM.
package gpu

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// Errors callers branch on. Every error of this package wraps one.
var (
	// ErrInvalid means the request itself is wrong: a malformed or
	// repeated address, no such device, or a device that is not a display
	// controller.
	ErrInvalid = errors.New("invalid gpu request")
	// ErrUnavailable means the host cannot hand the GPU over now: the
	// IOMMU is off, its group holds devices that would stay behind, it is
	// assigned to another VM, or vfio-pci would not take it.
	ErrUnavailable = errors.New("gpu unavailable")
)

// DefaultSysfs is where the kernel mounts sysfs.
const DefaultSysfs = "/sys"

// VFIODriver is the driver a device must be bound to before QEMU can
// take it.
const VFIODriver = "vfio-pci"

// Config configures a Host.
type Config struct {
	// Sysfs is sysfs's mount point; "" means DefaultSysfs.
	Sysfs string
	// Write writes one sysfs attribute; nil writes the file. Tests give a
	// fake kernel here (gputest.Sysfs.Write), which acts on the writes.
	Write func(path string, data []byte) error
	// PCIIDs are pci.ids files to name devices from; the first that exists
	// is used. nil means the usual places; an empty slice means none.
	PCIIDs []string
}

// Host is the machine's PCI devices, as sysfs shows them. It keeps no
// state: every call reads sysfs afresh.
type Host struct {
	root  string
	write func(path string, data []byte) error
	ids   []string
}

// New returns a Host.
func New(cfg Config) *Host {
	h := &Host{root: cfg.Sysfs, write: cfg.Write, ids: cfg.PCIIDs}
	if h.root == "" {
		h.root = DefaultSysfs
	}
	if h.write == nil {
		h.write = writeAttr
	}
	if h.ids == nil {
		h.ids = []string{"/usr/share/hwdata/pci.ids", "/usr/share/misc/pci.ids", "/usr/share/pci.ids"}
	}
	return h
}

// writeAttr writes a sysfs attribute, which exists already: never create
// a file.
func writeAttr(path string, data []byte) error {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// Device is one PCI device.
type Device struct {
	Address  Address
	VendorID uint16
	DeviceID uint16
	// Class is the 24-bit class code: base class, subclass, programming
	// interface (0x030000 is a VGA controller).
	Class uint32
	// Driver is the bound driver's name, "" when none is.
	Driver string
	// Bridge is set for a configuration header of type 1 (PCI-to-PCI) or
	// 2 (CardBus). A host bridge has a type 0 header and is an endpoint.
	Bridge bool
	// IOMMUGroup is the device's group, -1 when it has none.
	IOMMUGroup int
	// NUMANode is -1 when the platform does not say.
	NUMANode int
	// BootVGA is set for the display the firmware booted on: handing it
	// over takes the host's console away.
	BootVGA bool
}

// IsDisplay reports whether d is a display controller (base class 0x03).
func (d Device) IsDisplay() bool { return d.Class>>16 == 0x03 }

// IDs is "vendor:device" in hex, as lspci -n writes it.
func (d Device) IDs() string { return fmt.Sprintf("%04x:%04x", d.VendorID, d.DeviceID) }

// Describe names the device for people: its address, class and driver.
func (d Device) Describe() string {
	drv := d.Driver
	if drv == "" {
		drv = "none"
	}
	return fmt.Sprintf("%s (%s [%04x], %s, driver %s)", d.Address, ClassName(d.Class), d.Class>>8, d.IDs(), drv)
}

// ClassName names a class code's base class and subclass.
func ClassName(class uint32) string {
	if n, ok := classNames[class>>8]; ok {
		return n
	}
	if n, ok := classNames[class>>16<<8|0xff]; ok {
		return n
	}
	return "PCI device"
}

var classNames = map[uint32]string{
	0x0300: "VGA compatible controller", 0x0302: "3D controller", 0x0380: "Display controller", 0x03ff: "Display controller",
	0x0403: "Audio device", 0x04ff: "Multimedia controller",
	0x0200: "Ethernet controller", 0x0207: "InfiniBand controller", 0x0280: "Network controller", 0x02ff: "Network controller",
	0x0600: "Host bridge", 0x0601: "ISA bridge", 0x0604: "PCI bridge", 0x0607: "CardBus bridge", 0x06ff: "Bridge",
	0x0106: "SATA controller", 0x0108: "Non-Volatile memory controller", 0x01ff: "Mass storage controller",
	0x0c03: "USB controller", 0x0c05: "SMBus", 0x0c80: "Serial bus controller", 0x0cff: "Serial bus controller",
}

// pciDir is the sysfs directory of the device at a.
func (h *Host) pciDir(a Address) string {
	return filepath.Join(h.root, "bus", "pci", "devices", a.String())
}

func (h *Host) groupsDir() string { return filepath.Join(h.root, "kernel", "iommu_groups") }

// IOMMU reports whether the IOMMU is on: the kernel made at least one
// group. With the IOMMU off (or no driver for it) the directory is
// missing or empty.
func (h *Host) IOMMU() (bool, error) {
	ents, err := os.ReadDir(h.groupsDir())
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("read iommu groups: %w", err)
	}
	return len(ents) > 0, nil
}

// errIOMMUOff is the refusal for a host without IOMMU groups.
func errIOMMUOff() error {
	return fmt.Errorf("%w: the IOMMU is off on this host (no groups in /sys/kernel/iommu_groups): enable VT-d or AMD-Vi in the firmware and boot with intel_iommu=on or amd_iommu=on (docs/operator-guide.md, GPU passthrough)", ErrUnavailable)
}

// device reads the device at a. A device that does not exist is
// ErrInvalid.
func (h *Host) device(a Address) (Device, error) {
	dir := h.pciDir(a)
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		return Device{}, fmt.Errorf("%w: no PCI device %s on this host (carrel gpu ls lists the GPUs)", ErrInvalid, a)
	}
	d := Device{Address: a, IOMMUGroup: -1, NUMANode: -1}
	var err error
	if d.Class, err = readHex(dir, "class", 24); err != nil {
		return Device{}, err
	}
	v, err := readHex(dir, "vendor", 16)
	if err != nil {
		return Device{}, err
	}
	id, err := readHex(dir, "device", 16)
	if err != nil {
		return Device{}, err
	}
	d.VendorID, d.DeviceID = uint16(v), uint16(id)
	if d.Driver, err = linkBase(filepath.Join(dir, "driver")); err != nil {
		return Device{}, err
	}
	group, err := linkBase(filepath.Join(dir, "iommu_group"))
	if err != nil {
		return Device{}, err
	}
	if group != "" {
		if d.IOMMUGroup, err = strconv.Atoi(group); err != nil || d.IOMMUGroup < 0 {
			return Device{}, fmt.Errorf("%s: iommu_group links to %q", dir, group)
		}
	}
	if b, err := os.ReadFile(filepath.Join(dir, "numa_node")); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			d.NUMANode = n
		}
	}
	if b, err := os.ReadFile(filepath.Join(dir, "boot_vga")); err == nil {
		d.BootVGA = strings.TrimSpace(string(b)) == "1"
	}
	// The header type is byte 0x0e of configuration space (low 7 bits),
	// which anyone may read. Unreadable, the device counts as an endpoint:
	// the stricter reading.
	if cfg, err := readPrefix(filepath.Join(dir, "config"), 64); err == nil && len(cfg) > 0x0e {
		ht := cfg[0x0e] & 0x7f
		d.Bridge = ht == 1 || ht == 2
	}
	return d, nil
}

// readHex reads an attribute such as class ("0x030000").
func readHex(dir, name string, bits int) (uint32, error) {
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		return 0, fmt.Errorf("read %s: %w", name, err)
	}
	s := strings.TrimSpace(string(b))
	v, err := strconv.ParseUint(strings.TrimPrefix(s, "0x"), 16, bits)
	if err != nil || !strings.HasPrefix(s, "0x") {
		return 0, fmt.Errorf("%s/%s holds %.20q", dir, name, s)
	}
	return uint32(v), nil
}

func readPrefix(path string, n int) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b := make([]byte, n)
	m, err := f.Read(b)
	if m > 0 {
		err = nil
	}
	return b[:m], err
}

// linkBase is the last element of a symlink's target, "" when there is
// no link.
func linkBase(path string) (string, error) {
	t, err := os.Readlink(path)
	if errors.Is(err, os.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("read link %s: %w", path, err)
	}
	return filepath.Base(t), nil
}

// groupMembers returns the addresses in IOMMU group n, sorted.
func (h *Host) groupMembers(n int) ([]Address, error) {
	dir := filepath.Join(h.groupsDir(), strconv.Itoa(n), "devices")
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("read iommu group %d: %w", n, err)
	}
	out := make([]Address, 0, len(ents))
	for _, e := range ents {
		a, err := ParseAddress(e.Name())
		if err != nil {
			continue // not a PCI device (groups can hold others, rarely)
		}
		out = append(out, a)
	}
	slices.SortFunc(out, compare)
	return out, nil
}

// addresses lists every PCI device, sorted.
func (h *Host) addresses() ([]Address, error) {
	ents, err := os.ReadDir(filepath.Join(h.root, "bus", "pci", "devices"))
	if err != nil {
		return nil, fmt.Errorf("list PCI devices: %w", err)
	}
	out := make([]Address, 0, len(ents))
	for _, e := range ents {
		if a, err := ParseAddress(e.Name()); err == nil {
			out = append(out, a)
		}
	}
	slices.SortFunc(out, compare)
	return out, nil
}
