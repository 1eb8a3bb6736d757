// Package gputest builds fake sysfs trees for tests of GPU passthrough: the
// directories, attribute files and symlinks of /sys/bus/pci and
// /sys/kernel/iommu_groups, laid out as the kernel lays them out, plus a
// fake kernel (Sysfs.Write) that acts on the writes that bind and unbind
// drivers. Nothing here touches real hardware.
package gputest

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
)

// Dev describes one fake PCI device.
type Dev struct {
	Addr   string // "0000:01:00.0"
	Class  uint32 // 0x030000
	Vendor uint16
	Device uint16
	// Driver is bound at the start; Native is the driver the kernel binds
	// when it probes the device without an override ("" means Driver).
	Driver, Native string
	// Group is the IOMMU group, -1 for none.
	Group int
	// Bridge gives the device a type 1 (PCI-to-PCI) configuration header.
	Bridge  bool
	NUMA    int
	BootVGA bool
	// Parent, when set, is the address of the bridge the device sits
	// behind: its directory is nested in the bridge's, as in sysfs.
	Parent string
}

// Sysfs is a fake sysfs tree in a temporary directory.
type Sysfs struct {
	// Root is the tree's root, what Config.Sysfs takes.
	Root string

	t      testing.TB
	mu     sync.Mutex
	native map[string]string // device -> driver a probe binds
	writes []string
	// Fail makes writes to a path (relative to Root) fail with the error.
	Fail map[string]error
	// VFIODeclines names devices vfio-pci's probe declines: they stay
	// unbound.
	VFIODeclines map[string]bool
}

// New returns an empty tree: no devices, no IOMMU groups (the IOMMU is
// off until a device with a group is added), and the drivers named.
func New(t testing.TB, drivers ...string) *Sysfs {
	t.Helper()
	s := &Sysfs{Root: t.TempDir(), t: t, native: map[string]string{}, Fail: map[string]error{}}
	for _, d := range []string{"bus/pci/devices", "bus/pci/drivers", "kernel/iommu_groups"} {
		s.mkdir(d)
	}
	s.file("bus/pci/drivers_probe", "")
	for _, d := range drivers {
		s.AddDriver(d)
	}
	return s
}

func (s *Sysfs) path(rel string) string { return filepath.Join(s.Root, filepath.FromSlash(rel)) }

func (s *Sysfs) mkdir(rel string) {
	s.t.Helper()
	if err := os.MkdirAll(s.path(rel), 0o755); err != nil {
		s.t.Fatal(err)
	}
}

func (s *Sysfs) file(rel, content string) {
	s.t.Helper()
	if err := os.WriteFile(s.path(rel), []byte(content), 0o644); err != nil {
		s.t.Fatal(err)
	}
}

// symlink makes a relative link at rel pointing at target (both relative
// to Root), as sysfs's links are relative.
func (s *Sysfs) symlink(target, rel string) {
	s.t.Helper()
	r, err := filepath.Rel(filepath.Dir(s.path(rel)), s.path(target))
	if err != nil {
		s.t.Fatal(err)
	}
	if err := os.Symlink(r, s.path(rel)); err != nil {
		s.t.Fatal(err)
	}
}

// AddDriver adds a driver's directory under bus/pci/drivers.
func (s *Sysfs) AddDriver(name string) {
	s.mkdir("bus/pci/drivers/" + name)
	for _, f := range []string{"bind", "unbind", "new_id", "remove_id"} {
		s.file("bus/pci/drivers/"+name+"/"+f, "")
	}
}

// RemoveDriver removes a driver (its module unloaded).
func (s *Sysfs) RemoveDriver(name string) {
	if err := os.RemoveAll(s.path("bus/pci/drivers/" + name)); err != nil {
		s.t.Fatal(err)
	}
}

// devDir is the device's real directory, relative to Root.
func (s *Sysfs) devDir(addr string) string {
	t, err := os.Readlink(s.path("bus/pci/devices/" + addr))
	if err != nil {
		s.t.Fatalf("no fake device %s: %v", addr, err)
	}
	abs := filepath.Clean(filepath.Join(s.path("bus/pci/devices"), t))
	rel, _ := filepath.Rel(s.Root, abs)
	return filepath.ToSlash(rel)
}

// Add adds devices, with their attribute files, their driver and IOMMU
// group links, and their entries in the group's devices directory.
func (s *Sysfs) Add(devs ...Dev) {
	s.t.Helper()
	for _, d := range devs {
		dom, _, _ := strings.Cut(d.Addr, ":")
		dir := "devices/pci" + dom + ":" + d.Addr[len(dom)+1:len(dom)+3] + "/" + d.Addr
		if d.Parent != "" {
			dir = s.devDir(d.Parent) + "/" + d.Addr
		}
		s.mkdir(dir)
		s.file(dir+"/class", fmt.Sprintf("0x%06x\n", d.Class))
		s.file(dir+"/vendor", fmt.Sprintf("0x%04x\n", d.Vendor))
		s.file(dir+"/device", fmt.Sprintf("0x%04x\n", d.Device))
		s.file(dir+"/subsystem_vendor", fmt.Sprintf("0x%04x\n", d.Vendor))
		s.file(dir+"/subsystem_device", "0x0000\n")
		s.file(dir+"/numa_node", strconv.Itoa(d.NUMA)+"\n")
		s.file(dir+"/driver_override", "(null)\n")
		if d.Class>>16 == 0x03 {
			vga := "0\n"
			if d.BootVGA {
				vga = "1\n"
			}
			s.file(dir+"/boot_vga", vga)
		}
		// The first 64 bytes of configuration space: ids, class, header type.
		cfg := make([]byte, 64)
		cfg[0], cfg[1], cfg[2], cfg[3] = byte(d.Vendor), byte(d.Vendor>>8), byte(d.Device), byte(d.Device>>8)
		cfg[0x09], cfg[0x0a], cfg[0x0b] = byte(d.Class), byte(d.Class>>8), byte(d.Class>>16)
		if d.Bridge {
			cfg[0x0e] = 1
		}
		if err := os.WriteFile(s.path(dir+"/config"), cfg, 0o644); err != nil {
			s.t.Fatal(err)
		}
		s.symlink(dir, "bus/pci/devices/"+d.Addr)
		native := d.Native
		if native == "" {
			native = d.Driver
		}
		s.mu.Lock()
		s.native[d.Addr] = native
		s.mu.Unlock()
		if d.Driver != "" {
			s.bindLocked(d.Addr, d.Driver)
		}
		if d.Group >= 0 {
			g := "kernel/iommu_groups/" + strconv.Itoa(d.Group)
			s.mkdir(g + "/devices")
			s.file(g+"/type", "DMA\n")
			s.symlink(g, dir+"/iommu_group")
			s.symlink(dir, g+"/devices/"+d.Addr)
		}
	}
}

// bindLocked links addr to driver both ways, as the kernel does.
func (s *Sysfs) bindLocked(addr, driver string) {
	dir := s.devDir(addr)
	s.symlink("bus/pci/drivers/"+driver, dir+"/driver")
	s.symlink(dir, "bus/pci/drivers/"+driver+"/"+addr)
}

func (s *Sysfs) unbindLocked(addr, driver string) {
	os.Remove(s.path(s.devDir(addr) + "/driver"))
	os.Remove(s.path("bus/pci/drivers/" + driver + "/" + addr))
}

// Driver returns the driver addr is bound to, "" when none.
func (s *Sysfs) Driver(addr string) string {
	t, err := os.Readlink(s.path(s.devDir(addr) + "/driver"))
	if err != nil {
		return ""
	}
	return filepath.Base(t)
}

// Override returns addr's driver_override, "" when unset.
func (s *Sysfs) Override(addr string) string {
	b, err := os.ReadFile(s.path(s.devDir(addr) + "/driver_override"))
	if err != nil {
		s.t.Fatal(err)
	}
	v := strings.TrimSpace(string(b))
	if v == "(null)" {
		return ""
	}
	return v
}

// Writes returns every write so far, as "path <- data" with the path
// relative to Root.
func (s *Sysfs) Writes() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.writes...)
}

// Write is the fake kernel: it acts on a write to a sysfs attribute as
// the kernel would. It understands driver_override, a driver's bind and
// unbind, and bus/pci/drivers_probe; any other write fails with EACCES.
func (s *Sysfs) Write(path string, data []byte) error {
	rel, err := filepath.Rel(s.Root, path)
	if err != nil || strings.HasPrefix(rel, "..") {
		return fmt.Errorf("write outside the fake sysfs: %s", path)
	}
	rel = filepath.ToSlash(rel)
	val := strings.TrimSpace(string(data))
	s.mu.Lock()
	defer s.mu.Unlock()
	s.writes = append(s.writes, rel+" <- "+val)
	if err := s.Fail[rel]; err != nil {
		return &os.PathError{Op: "write", Path: path, Err: err}
	}
	parts := strings.Split(rel, "/")
	exists := func(addr string) bool {
		_, err := os.Lstat(s.path("bus/pci/devices/" + addr))
		return err == nil
	}
	driverOf := func(addr string) string {
		t, err := os.Readlink(s.path(s.devDir(addr) + "/driver"))
		if err != nil {
			return ""
		}
		return filepath.Base(t)
	}
	hasDriver := func(name string) bool {
		_, err := os.Stat(s.path("bus/pci/drivers/" + name))
		return name != "" && err == nil
	}
	fail := func(errno syscall.Errno) error { return &os.PathError{Op: "write", Path: path, Err: errno} }
	switch {
	case len(parts) == 5 && parts[0] == "bus" && parts[2] == "devices" && parts[4] == "driver_override":
		if !exists(parts[3]) {
			return fail(syscall.ENODEV)
		}
		if val == "" {
			val = "(null)"
		}
		return os.WriteFile(s.path(s.devDir(parts[3])+"/driver_override"), []byte(val+"\n"), 0o644)
	case len(parts) == 5 && parts[2] == "drivers" && parts[4] == "unbind":
		if !exists(val) || driverOf(val) != parts[3] {
			return fail(syscall.ENODEV)
		}
		s.unbindLocked(val, parts[3])
		return nil
	case len(parts) == 5 && parts[2] == "drivers" && parts[4] == "bind":
		if !exists(val) || driverOf(val) != "" {
			return fail(syscall.EBUSY)
		}
		s.bindLocked(val, parts[3])
		return nil
	case rel == "bus/pci/drivers_probe":
		if !exists(val) {
			return fail(syscall.ENODEV)
		}
		if driverOf(val) != "" {
			return nil
		}
		// With an override set, only that driver may bind.
		want := s.native[val]
		b, _ := os.ReadFile(s.path(s.devDir(val) + "/driver_override"))
		if o := strings.TrimSpace(string(b)); o != "(null)" {
			want = o
		}
		if hasDriver(want) && !(want == "vfio-pci" && s.VFIODeclines[val]) {
			s.bindLocked(val, want)
		}
		return nil
	}
	return fail(syscall.EACCES)
}
