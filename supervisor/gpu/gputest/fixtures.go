package gputest

import (
	"os"
	"path/filepath"
	"testing"
)

// Drivers are the drivers the fixtures' devices use, plus vfio-pci.
var Drivers = []string{"pcieport", "nvidia", "snd_hda_intel", "amdgpu", "igb", "i915", "vfio-pci"}

// Addresses of the fixtures' GPUs.
const (
	NVIDIAGPU   = "0000:01:00.0"
	NVIDIAAudio = "0000:01:00.1"
	NVIDIAPort  = "0000:00:01.0"
	AMDGPU      = "0000:03:00.0"
	AMDAudio    = "0000:03:00.1"
	SharedNIC   = "0000:04:00.0"
	IntelGPU    = "0000:00:02.0"
	HostBridge  = "0000:00:00.0"
)

// NVIDIAWithAudio is a discrete NVIDIA card in the CPU's PCIe root port,
// as on most desktops: IOMMU group 1 holds the root port (a bridge, bound
// to pcieport), the GPU (nvidia) and its HDMI audio function
// (snd_hda_intel). The whole group can be assigned.
func NVIDIAWithAudio() []Dev {
	return []Dev{
		{Addr: NVIDIAPort, Class: 0x060400, Vendor: 0x8086, Device: 0x1901, Driver: "pcieport", Group: 1, Bridge: true, NUMA: -1},
		{Addr: NVIDIAGPU, Class: 0x030000, Vendor: 0x10de, Device: 0x2204, Driver: "nvidia", Group: 1, NUMA: -1, Parent: NVIDIAPort},
		{Addr: NVIDIAAudio, Class: 0x040300, Vendor: 0x10de, Device: 0x1aef, Driver: "snd_hda_intel", Group: 1, NUMA: -1, Parent: NVIDIAPort},
	}
}

// H200InAVM is what a cloud VM with one NVIDIA H200 passed through to it
// shows, as read from a real one's sysfs: a 3D controller (class 0x0302)
// on the root bus, bound to nvidia, with no NUMA node and no IOMMU groups.
func H200InAVM() []Dev {
	return []Dev{
		{Addr: "0000:00:06.0", Class: 0x030200, Vendor: 0x10de, Device: 0x2335, Driver: "nvidia", Group: -1, NUMA: -1},
	}
}

// AMDSharingNIC is an AMD card behind chipset root ports without ACS:
// IOMMU group 8 holds both root ports, the GPU and its audio, and an
// unrelated Intel NIC (igb) on another bus. The GPU cannot be assigned.
func AMDSharingNIC() []Dev {
	return []Dev{
		{Addr: "0000:00:1c.0", Class: 0x060400, Vendor: 0x8086, Device: 0xa338, Driver: "pcieport", Group: 8, Bridge: true, NUMA: 0},
		{Addr: "0000:00:1c.4", Class: 0x060400, Vendor: 0x8086, Device: 0xa33c, Driver: "pcieport", Group: 8, Bridge: true, NUMA: 0},
		{Addr: AMDGPU, Class: 0x030000, Vendor: 0x1002, Device: 0x73bf, Driver: "amdgpu", Group: 8, NUMA: 0, Parent: "0000:00:1c.0"},
		{Addr: AMDAudio, Class: 0x040300, Vendor: 0x1002, Device: 0xab28, Driver: "snd_hda_intel", Group: 8, NUMA: 0, Parent: "0000:00:1c.0"},
		{Addr: SharedNIC, Class: 0x020000, Vendor: 0x8086, Device: 0x1533, Driver: "igb", Group: 8, NUMA: 0, Parent: "0000:00:1c.4"},
	}
}

// IntelIntegrated is a laptop's integrated Intel GPU (i915), the display
// the firmware booted on, alone in IOMMU group 2, beside the host bridge
// in group 0.
func IntelIntegrated() []Dev {
	return []Dev{
		{Addr: HostBridge, Class: 0x060000, Vendor: 0x8086, Device: 0x9a14, Group: 0, NUMA: -1},
		{Addr: IntelGPU, Class: 0x030000, Vendor: 0x8086, Device: 0x9a49, Driver: "i915", Group: 2, NUMA: -1, BootVGA: true},
	}
}

// WithoutIOMMU is devs as a host without an IOMMU shows them: no group.
func WithoutIOMMU(devs []Dev) []Dev {
	out := append([]Dev(nil), devs...)
	for i := range out {
		out[i].Group = -1
	}
	return out
}

// PCIIDs writes a small pci.ids naming the fixtures' devices and returns
// its path.
func PCIIDs(t testing.TB) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "pci.ids")
	const ids = `# fake pci.ids for tests
10de  NVIDIA Corporation
	1aef  GA102 High Definition Audio Controller
	2204  GA102 [GeForce RTX 3090]
		10de 147d  GeForce RTX 3090
1002  Advanced Micro Devices, Inc. [AMD/ATI]
	73bf  Navi 21 [Radeon RX 6800/6800 XT / 6900 XT]
8086  Intel Corporation
	1533  I210 Gigabit Network Connection
C 03  Display controller
	00  VGA compatible controller
`
	if err := os.WriteFile(p, []byte(ids), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}
