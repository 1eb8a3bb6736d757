package gpu_test

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/supervisor/gpu"
	"github.com/carrel-os/carrel/supervisor/gpu/gputest"
)

// fakeHost returns a Host on a fake sysfs tree holding devs.
func fakeHost(t *testing.T, devs ...[]gputest.Dev) (*gpu.Host, *gputest.Sysfs) {
	t.Helper()
	t.Log("fake sysfs tree: real VFIO passthrough is not exercised here")
	s := gputest.New(t, gputest.Drivers...)
	for _, d := range devs {
		s.Add(d...)
	}
	return gpu.New(gpu.Config{Sysfs: s.Root, Write: s.Write, PCIIDs: []string{gputest.PCIIDs(t)}}), s
}

func addr(t *testing.T, s string) gpu.Address {
	t.Helper()
	a, err := gpu.ParseAddress(s)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func TestParseAddress(t *testing.T) {
	good := map[string]string{
		"0000:41:00.0":  "0000:41:00.0",
		"0000:4A:1F.7":  "0000:4a:1f.7",
		"10000:e1:00.0": "10000:e1:00.0", // an Intel VMD domain
		"00000:01:00.1": "0000:01:00.1",
	}
	for in, want := range good {
		a, err := gpu.ParseAddress(in)
		if err != nil || a.String() != want {
			t.Errorf("ParseAddress(%q) = %v, %v; want %s", in, a, err, want)
		}
	}
	for _, in := range []string{"", "41:00.0", "0000:41:00", "0000:41:20.0", "0000:41:00.8", "000:41:00.0", "0000:041:00.0",
		"0000:+1:00.0", "0x00:41:00.0", "0000:41:00.0 ", "0000:41:0g.0", "123456789:00:00.0", "0000:41:00.0.0"} {
		if a, err := gpu.ParseAddress(in); !errors.Is(err, gpu.ErrInvalid) {
			t.Errorf("ParseAddress(%q) = %v, %v; want ErrInvalid", in, a, err)
		}
	}
	if _, err := gpu.ParseAddresses([]string{"0000:01:00.0", "0000:01:00.0"}); !errors.Is(err, gpu.ErrInvalid) || !strings.Contains(err.Error(), "twice") {
		t.Errorf("a repeated address: %v", err)
	}
	if _, err := gpu.ParseAddresses([]string{"0000:0A:00.0", "0000:0a:00.0"}); !errors.Is(err, gpu.ErrInvalid) {
		t.Errorf("one address spelled twice: %v", err)
	}
	if _, err := gpu.ParseAddresses(make([]string, gpu.MaxGPUs+1)); !errors.Is(err, gpu.ErrInvalid) {
		t.Errorf("too many: %v", err)
	}
}

func TestListNVIDIAWithAudio(t *testing.T) {
	h, _ := fakeHost(t, gputest.NVIDIAWithAudio())
	inv, err := h.List()
	if err != nil {
		t.Fatal(err)
	}
	if !inv.IOMMU || len(inv.GPUs) != 1 {
		t.Fatalf("inventory: %+v", inv)
	}
	g := inv.GPUs[0]
	if g.Address.String() != gputest.NVIDIAGPU || g.IDs() != "10de:2204" || g.Driver != "nvidia" || g.IOMMUGroup != 1 || g.Class != 0x030000 {
		t.Errorf("gpu: %+v", g)
	}
	if g.Name != "NVIDIA Corporation GA102 [GeForce RTX 3090]" {
		t.Errorf("name %q", g.Name)
	}
	if !g.Assignable || g.Reason != "" {
		t.Errorf("assignable %v, reason %q", g.Assignable, g.Reason)
	}
	roles := map[string]gpu.Role{}
	for _, m := range g.Group {
		roles[m.Address.String()] = m.Role
	}
	want := map[string]gpu.Role{gputest.NVIDIAPort: gpu.RoleBridge, gputest.NVIDIAAudio: gpu.RolePassed}
	if !reflect.DeepEqual(roles, want) {
		t.Errorf("group roles %v, want %v", roles, want)
	}
	var passed []string
	for _, d := range g.Passed() {
		passed = append(passed, d.Address.String()+" "+d.Driver)
	}
	if !reflect.DeepEqual(passed, []string{gputest.NVIDIAGPU + " nvidia", gputest.NVIDIAAudio + " snd_hda_intel"}) {
		t.Errorf("passed along: %v", passed)
	}
}

func TestListGroupSharedWithNIC(t *testing.T) {
	h, _ := fakeHost(t, gputest.AMDSharingNIC())
	inv, err := h.List()
	if err != nil {
		t.Fatal(err)
	}
	if len(inv.GPUs) != 1 {
		t.Fatalf("gpus: %+v", inv.GPUs)
	}
	g := inv.GPUs[0]
	if g.Assignable {
		t.Fatalf("a GPU sharing its group with a NIC is assignable: %+v", g)
	}
	// The NIC blocks; the bridges and the GPU's own audio do not.
	if !strings.Contains(g.Reason, "IOMMU group 8 also holds 0000:04:00.0 (Ethernet controller [0200], 8086:1533, driver igb)") ||
		strings.Contains(g.Reason, "00:1c.") || strings.Contains(g.Reason, gputest.AMDAudio) {
		t.Errorf("reason: %s", g.Reason)
	}
	roles := map[string]gpu.Role{}
	for _, m := range g.Group {
		roles[m.Address.String()] = m.Role
	}
	want := map[string]gpu.Role{"0000:00:1c.0": gpu.RoleBridge, "0000:00:1c.4": gpu.RoleBridge, gputest.AMDAudio: gpu.RolePassed, gputest.SharedNIC: gpu.RoleBlocking}
	if !reflect.DeepEqual(roles, want) {
		t.Errorf("group roles %v, want %v", roles, want)
	}
	if g.Name != "Advanced Micro Devices, Inc. [AMD/ATI] Navi 21 [Radeon RX 6800/6800 XT / 6900 XT]" || g.NUMANode != 0 {
		t.Errorf("name %q, numa %d", g.Name, g.NUMANode)
	}
}

func TestListIntegratedIntel(t *testing.T) {
	h, _ := fakeHost(t, gputest.IntelIntegrated())
	inv, err := h.List()
	if err != nil {
		t.Fatal(err)
	}
	if len(inv.GPUs) != 1 {
		t.Fatalf("the host bridge is listed, or the GPU is not: %+v", inv.GPUs)
	}
	g := inv.GPUs[0]
	if g.Address.String() != gputest.IntelGPU || !g.Assignable || !g.BootVGA || g.Driver != "i915" || len(g.Group) != 0 || g.IOMMUGroup != 2 {
		t.Errorf("gpu: %+v", g)
	}
	// pci.ids names the vendor but not this device.
	if g.Name != "Intel Corporation" {
		t.Errorf("name %q", g.Name)
	}
}

func TestListWithoutIOMMU(t *testing.T) {
	h, s := fakeHost(t, gputest.WithoutIOMMU(gputest.NVIDIAWithAudio()))
	for _, state := range []string{"empty", "missing"} {
		if state == "missing" {
			if err := os.Remove(filepath.Join(s.Root, "kernel", "iommu_groups")); err != nil {
				t.Fatal(err)
			}
		}
		inv, err := h.List()
		if err != nil {
			t.Fatal(err)
		}
		if inv.IOMMU || len(inv.GPUs) != 1 || inv.GPUs[0].Assignable || inv.GPUs[0].Reason != "the IOMMU is off" || inv.GPUs[0].IOMMUGroup != -1 {
			t.Errorf("%s iommu_groups: %+v", state, inv)
		}
	}
}

// TestListH200InAVM is the layout TestRealHost met on a machine with an
// H200: listed, named by its vendor (pci.ids here predates it), and not
// assignable, because the VM it sits in has no IOMMU.
func TestListH200InAVM(t *testing.T) {
	h, _ := fakeHost(t, gputest.H200InAVM())
	inv, err := h.List()
	if err != nil {
		t.Fatal(err)
	}
	if inv.IOMMU || len(inv.GPUs) != 1 {
		t.Fatalf("inventory %+v", inv)
	}
	g := inv.GPUs[0]
	if g.Address.String() != "0000:00:06.0" || g.IDs() != "10de:2335" || gpu.ClassName(g.Class) != "3D controller" ||
		g.Driver != "nvidia" || g.Assignable || g.Reason != "the IOMMU is off" || g.IOMMUGroup != -1 || g.Name != "NVIDIA Corporation" {
		t.Errorf("gpu %+v (%s)", g, g.Describe())
	}
}

func TestNamesWithoutPCIIDs(t *testing.T) {
	s := gputest.New(t, gputest.Drivers...)
	s.Add(gputest.NVIDIAWithAudio()...)
	h := gpu.New(gpu.Config{Sysfs: s.Root, Write: s.Write, PCIIDs: []string{filepath.Join(t.TempDir(), "none")}})
	inv, err := h.List()
	if err != nil {
		t.Fatal(err)
	}
	if inv.GPUs[0].Name != "NVIDIA Corporation" {
		t.Errorf("name without pci.ids: %q", inv.GPUs[0].Name)
	}
}

// dualGPU is a card with two GPUs as functions of one slot, sharing IOMMU
// group 9.
func dualGPU() []gputest.Dev {
	return []gputest.Dev{
		{Addr: "0000:05:00.0", Class: 0x030200, Vendor: 0x10de, Device: 0x20b5, Driver: "nvidia", Group: 9},
		{Addr: "0000:05:00.1", Class: 0x030200, Vendor: 0x10de, Device: 0x20b5, Driver: "nvidia", Group: 9},
	}
}

// TestCheckRefuses checks every refusal and its reason.
func TestCheckRefuses(t *testing.T) {
	h, _ := fakeHost(t, gputest.NVIDIAWithAudio(), gputest.AMDSharingNIC(), gputest.IntelIntegrated(), dualGPU())
	noIOMMU, _ := fakeHost(t, gputest.WithoutIOMMU(gputest.NVIDIAWithAudio()))
	cases := []struct {
		name string
		host *gpu.Host
		want []string
		held map[string][]string
		is   error
		says []string
	}{
		{"iommu off", noIOMMU, []string{gputest.NVIDIAGPU}, nil, gpu.ErrUnavailable, []string{"the IOMMU is off", "intel_iommu=on or amd_iommu=on"}},
		{"no such device", h, []string{"0000:99:00.0"}, nil, gpu.ErrInvalid, []string{"no PCI device 0000:99:00.0"}},
		{"not a display controller", h, []string{gputest.SharedNIC}, nil, gpu.ErrInvalid, []string{"0000:04:00.0 is not a display controller", "Ethernet controller"}},
		{"the gpu's audio", h, []string{gputest.NVIDIAAudio}, nil, gpu.ErrInvalid, []string{"not a display controller", "Audio device"}},
		{"group shared with a nic", h, []string{gputest.AMDGPU}, nil, gpu.ErrUnavailable,
			[]string{"GPU 0000:03:00.0 cannot be assigned", "IOMMU group 8 also holds 0000:04:00.0", "driver igb", "would stay behind"}},
		{"assigned to another vm", h, []string{gputest.NVIDIAGPU}, map[string][]string{"train": {gputest.NVIDIAGPU}}, gpu.ErrUnavailable,
			[]string{`GPU 0000:01:00.0 is already assigned to VM "train"`}},
		{"group held by another vm", h, []string{"0000:05:00.1"}, map[string][]string{"a": {"0000:05:00.0"}}, gpu.ErrUnavailable,
			[]string{`GPU 0000:05:00.1 is in IOMMU group 9, which VM "a" holds with its GPU 0000:05:00.0`}},
		{"one of two refused", h, []string{gputest.IntelGPU, gputest.AMDGPU}, nil, gpu.ErrUnavailable, []string{"0000:03:00.0 cannot be assigned"}},
		{"malformed", h, []string{"41:00.0"}, nil, gpu.ErrInvalid, []string{`"41:00.0"`}},
		{"repeated", h, []string{gputest.NVIDIAGPU, strings.ToUpper(gputest.NVIDIAGPU)}, nil, gpu.ErrInvalid, []string{"twice"}},
	}
	for _, c := range cases {
		p, err := c.host.Check(c.want, c.held)
		if !errors.Is(err, c.is) {
			t.Errorf("%s: Check = %+v, %v; want %v", c.name, p, err, c.is)
			continue
		}
		for _, s := range c.says {
			if !strings.Contains(err.Error(), s) {
				t.Errorf("%s: %q does not say %q", c.name, err, s)
			}
		}
	}
}

func TestCheckPlansTheWholeGroup(t *testing.T) {
	h, _ := fakeHost(t, gputest.NVIDIAWithAudio(), gputest.IntelIntegrated(), dualGPU())
	// Another VM's GPU elsewhere does not matter.
	p, err := h.Check([]string{gputest.NVIDIAGPU, gputest.IntelGPU}, map[string][]string{"other": {"0000:05:00.0"}})
	if err != nil {
		t.Fatal(err)
	}
	got := gpu.Strings(p.Addresses())
	want := []string{gputest.IntelGPU, gputest.NVIDIAGPU, gputest.NVIDIAAudio} // sorted, bridge left out
	if !reflect.DeepEqual(got, want) || len(p.GPUs) != 2 {
		t.Errorf("plan devices %v, want %v (gpus %d)", got, want, len(p.GPUs))
	}
	// Both GPUs of one slot: each device once.
	p, err = h.Check([]string{"0000:05:00.1", "0000:05:00.0"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := gpu.Strings(p.Addresses()); !reflect.DeepEqual(got, []string{"0000:05:00.0", "0000:05:00.1"}) {
		t.Errorf("dual gpu plan: %v", got)
	}
	// No GPUs asked for: nothing to do, and sysfs need not even exist.
	if p, err := gpu.New(gpu.Config{Sysfs: filepath.Join(t.TempDir(), "none")}).Check(nil, nil); err != nil || len(p.Devices) != 0 {
		t.Errorf("empty request: %+v, %v", p, err)
	}
}

// TestRealHost reads this machine's sysfs, read-only, and lists its GPUs
// as carreld would. It never binds a device: real passthrough needs a host
// with an IOMMU and a spare GPU, and changes the host's driver binding.
func TestRealHost(t *testing.T) {
	h := gpu.New(gpu.Config{})
	inv, err := h.List()
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range inv.GPUs {
		if g.Address.String() == "" || g.IDs() == "0000:0000" {
			t.Errorf("GPU %+v: no address or ids", g.Device)
		}
		if !inv.IOMMU && g.Assignable {
			t.Errorf("%s is assignable on a host without IOMMU groups", g.Address)
		}
		t.Logf("%s %s [%s] class %06x group %d driver %q assignable %v %s", g.Address, g.Name, g.IDs(), g.Class, g.IOMMUGroup, g.Driver, g.Assignable, g.Reason)
	}
	t.Logf("IOMMU groups: %v; %d GPUs", inv.IOMMU, len(inv.GPUs))
	t.Log("real GPU passthrough not exercised: this test only lists the host's GPUs; no device is bound to vfio-pci")
}
