package libvirt

import (
	"context"
	"fmt"
	"strings"
	"testing"

	lv "github.com/digitalocean/go-libvirt"
	"libvirt.org/go/libvirtxml"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/accel"
	"github.com/carrel-os/carrel/supervisor/driver"
	"github.com/carrel-os/carrel/supervisor/gpu"
	"github.com/carrel-os/carrel/supervisor/gpu/gputest"
)

func testConfig() domainConfig {
	return domainConfig{
		Spec: driver.Spec{
			Name:        "demo",
			Kernel:      "/var/lib/carrel/images/blobs/sha256/k",
			Initrd:      "/var/lib/carrel/images/blobs/sha256/i",
			Cmdline:     "console=ttyS0 quiet panic=-1",
			MemoryBytes: 768 << 20,
			CPUs:        2,
			Dir:         "/var/lib/carrel/vms/demo",
		},
		Name:          "carrel-demo",
		UUID:          "6f1c9a52-3c1e-4d7b-9a43-0c2f6d1e8b11",
		Accelerator:   accel.TCG,
		User:          "+64055:+64055",
		AgentSocket:   "/var/lib/carrel/vms/demo/agent.sock",
		DataSocket:    "/var/lib/carrel/vms/demo/data.sock",
		ConsoleSocket: "/var/lib/carrel/vms/demo/console.sock",
	}
}

// parse builds the domain XML and reads it back the way libvirt would.
func parse(t *testing.T, c domainConfig) *libvirtxml.Domain {
	t.Helper()
	x, err := domainXML(c)
	if err != nil {
		t.Fatal(err)
	}
	var d libvirtxml.Domain
	if err := d.Unmarshal(x); err != nil {
		t.Fatalf("parse back: %v\n%s", err, x)
	}
	return &d
}

func TestDomainXML(t *testing.T) {
	c := testConfig()
	d := parse(t, c)

	if d.Type != "qemu" || d.Name != "carrel-demo" || d.UUID != c.UUID {
		t.Errorf("type %q name %q uuid %q", d.Type, d.Name, d.UUID)
	}
	if d.Memory == nil || d.Memory.Unit != "KiB" || d.Memory.Value != 768<<10 {
		t.Errorf("memory: %+v", d.Memory)
	}
	if d.VCPU == nil || d.VCPU.Value != 2 {
		t.Errorf("vcpu: %+v", d.VCPU)
	}
	if d.CPU == nil || d.CPU.Mode != "maximum" || len(d.CPU.Features) != 1 || d.CPU.Features[0] != (libvirtxml.DomainCPUFeature{Policy: "disable", Name: "erms"}) {
		t.Errorf("cpu under tcg: %+v", d.CPU)
	}
	// Host limits: 768 MiB of guest and 1.5 GiB for TCG's translation
	// cache; 2 vCPUs and one CPU more, for the whole domain.
	checkLimits(t, c, d, (768<<10)+(1536<<10), 300000)
	// Direct kernel boot; the tcg clock fix is appended.
	o := d.OS
	if o == nil || o.Type == nil || o.Type.Machine != "q35" || o.Type.Type != "hvm" ||
		o.Kernel != c.Spec.Kernel || o.Initrd != c.Spec.Initrd ||
		o.Cmdline != "console=ttyS0 quiet panic=-1 tsc=reliable" || o.Loader != nil || len(o.BootDevices) != 0 {
		t.Errorf("os: %+v", o)
	}
	if d.Features == nil || d.Features.ACPI == nil {
		t.Error("no acpi: the guest could not power off")
	}
	if d.OnPoweroff != "destroy" || d.OnReboot != "destroy" || d.OnCrash != "destroy" {
		t.Errorf("lifecycle actions: %s %s %s", d.OnPoweroff, d.OnReboot, d.OnCrash)
	}

	dev := d.Devices
	if dev == nil {
		t.Fatal("no devices")
	}
	if len(dev.Interfaces) != 0 {
		t.Errorf("the vm has a nic: %+v", dev.Interfaces)
	}
	if len(dev.Disks) != 0 || len(dev.Graphics) != 0 || len(dev.Videos) != 0 || len(dev.Hostdevs) != 0 {
		t.Errorf("unexpected devices: disks %d graphics %d videos %d hostdevs %d", len(dev.Disks), len(dev.Graphics), len(dev.Videos), len(dev.Hostdevs))
	}
	if dev.VSock != nil {
		t.Errorf("vsock without a cid in the spec: %+v", dev.VSock)
	}
	if dev.MemBalloon == nil || dev.MemBalloon.Model != "none" {
		t.Errorf("memballoon: %+v", dev.MemBalloon)
	}
	// The agent's port and the data port, in that order: libvirt numbers
	// them 1 and 2 on the virtio-serial controller, as QEMU does the qemu
	// driver's.
	if len(dev.Channels) != 2 {
		t.Fatalf("channels: %+v", dev.Channels)
	}
	for i, want := range []struct{ path, name string }{{c.AgentSocket, protocol.SerialPortName}, {c.DataSocket, protocol.DataPortName}} {
		ch := dev.Channels[i]
		if ch.Source == nil || ch.Source.UNIX == nil || ch.Source.UNIX.Mode != "bind" || ch.Source.UNIX.Path != want.path ||
			ch.Target == nil || ch.Target.VirtIO == nil || ch.Target.VirtIO.Name != want.name {
			t.Errorf("channel %s: %+v %+v", want.name, ch.Source, ch.Target)
		}
	}
	c.Spec.NoDataPort = true
	if chs := parse(t, c).Devices.Channels; len(chs) != 1 || chs[0].Target.VirtIO.Name != protocol.SerialPortName {
		t.Errorf("channels without a data port: %+v", chs)
	}
	if len(dev.Serials) != 1 {
		t.Fatalf("serials: %+v", dev.Serials)
	}
	se := dev.Serials[0]
	if se.Source == nil || se.Source.UNIX == nil || se.Source.UNIX.Mode != "bind" || se.Source.UNIX.Path != c.ConsoleSocket ||
		se.Target == nil || se.Target.Port == nil || *se.Target.Port != 0 {
		t.Errorf("console: %+v %+v", se.Source, se.Target)
	}

	// QEMU runs as libvirt's user, and libvirt chowns nothing.
	if len(d.SecLabel) != 1 || d.SecLabel[0].Model != "dac" || d.SecLabel[0].Type != "static" ||
		d.SecLabel[0].Relabel != "no" || d.SecLabel[0].Label != "+64055:+64055" {
		t.Errorf("seclabel: %+v", d.SecLabel)
	}

	if d.Metadata == nil {
		t.Fatal("no metadata")
	}
	m, err := parseMetadata(d.Metadata.XML)
	if err != nil {
		t.Fatal(err)
	}
	if m.VM != "demo" || m.Dir != c.Spec.Dir {
		t.Errorf("metadata: %+v", m)
	}
	if !strings.Contains(d.Metadata.XML, `xmlns:carrel="`+MetadataNS+`"`) {
		t.Errorf("metadata is not in carrel's namespace: %s", d.Metadata.XML)
	}
}

func TestDomainXMLVsockAndKVM(t *testing.T) {
	c := testConfig()
	c.Spec.CID = 7
	c.Accelerator = accel.KVM
	c.Spec.Cmdline = "console=ttyS0"
	d := parse(t, c)
	if d.Type != "kvm" || d.CPU == nil || d.CPU.Mode != "host-passthrough" || len(d.CPU.Features) != 0 {
		t.Errorf("kvm domain: type %q cpu %+v", d.Type, d.CPU)
	}
	if d.OS.Cmdline != "console=ttyS0" {
		t.Errorf("cmdline under kvm: %q", d.OS.Cmdline)
	}
	checkLimits(t, c, d, (768<<10)+(512<<10), 300000)
	// libvirt picks the CID: the spec's only asks for a device.
	v := d.Devices.VSock
	if v == nil || v.Model != "virtio" || v.CID == nil || v.CID.Auto != "yes" || v.CID.Address != "" {
		t.Errorf("vsock: %+v", v)
	}
}

// checkLimits checks the memory hard limit (KiB) set on the paused domain
// and the domain's CPU quota per 100 ms period.
func checkLimits(t *testing.T, c domainConfig, d *libvirtxml.Domain, hardKiB uint64, quota int64) {
	t.Helper()
	p := memoryLimit(c.Spec, c.Accelerator)
	if p.Field != "hard_limit" || p.Value.D != uint32(lv.TypedParamUllong) || p.Value.I != hardKiB {
		t.Errorf("memory limit: %+v, want hard_limit %d KiB", p, hardKiB)
	}
	// In the XML, libvirt would also raise QEMU's RLIMIT_MEMLOCK to it.
	if d.MemoryTune != nil {
		t.Errorf("memtune in the xml: %+v", d.MemoryTune)
	}
	ct := d.CPUTune
	if ct == nil || ct.GlobalPeriod == nil || ct.GlobalPeriod.Value != 100000 || ct.GlobalQuota == nil || ct.GlobalQuota.Value != quota {
		t.Fatalf("cputune: %+v, want global quota %d per 100000 µs", ct, quota)
	}
	// A per-vCPU quota would let QEMU's other threads run unbounded.
	if ct.Period != nil || ct.Quota != nil || ct.EmulatorQuota != nil {
		t.Errorf("cputune sets per-thread limits: %+v", ct)
	}
}

func TestDomainXMLLimitsFollowTheSize(t *testing.T) {
	c := testConfig()
	c.Spec.CPUs, c.Spec.MemoryBytes = 4, 2<<30
	checkLimits(t, c, parse(t, c), (2<<20)+(1536<<10), 500000)
}

func TestDomainXMLDisks(t *testing.T) {
	c := testConfig()
	c.Spec.Disks = []driver.Disk{
		{Path: "/var/lib/carrel/images/blobs/sha256/s", Format: driver.FormatRaw, ReadOnly: true, Serial: protocol.SystemSerial},
		{Path: "/var/lib/carrel/vms/demo/workspace.qcow2", Format: driver.FormatQCOW2, Backing: "/var/lib/carrel/images/blobs/sha256/t", Serial: protocol.WorkspaceSerial},
	}
	d := parse(t, c)
	if len(d.Devices.Disks) != 2 {
		t.Fatalf("disks: %+v", d.Devices.Disks)
	}
	r := d.Devices.Disks[0]
	if r.Driver == nil || r.Driver.Type != "raw" || r.Driver.Discard != "" || r.ReadOnly == nil || r.BackingStore != nil ||
		r.Target == nil || r.Target.Dev != "vda" || r.Serial != protocol.SystemSerial {
		t.Errorf("read-only disk: %+v", r)
	}
	k := d.Devices.Disks[1]
	if k.Device != "disk" || k.Driver == nil || k.Driver.Type != "qcow2" || k.Driver.Discard != "unmap" ||
		k.Source == nil || k.Source.File == nil || k.Source.File.File != c.Spec.Disks[1].Path ||
		k.Target == nil || k.Target.Bus != "virtio" || k.Target.Dev != "vdb" || k.Serial != protocol.WorkspaceSerial || k.ReadOnly != nil {
		t.Errorf("disk: %+v", k)
	}
	b := k.BackingStore
	if b == nil || b.Format == nil || b.Format.Type != "raw" || b.Source == nil || b.Source.File == nil ||
		b.Source.File.File != c.Spec.Disks[1].Backing || b.BackingStore == nil || b.BackingStore.Format != nil ||
		(b.BackingStore.Source != nil && b.BackingStore.Source.File != nil) {
		t.Errorf("backing chain: %+v", b)
	}
}

func TestDomainXMLKeepsExplicitTSC(t *testing.T) {
	c := testConfig()
	c.Spec.Cmdline = "console=ttyS0 tsc=unstable"
	if got := parse(t, c).OS.Cmdline; got != "console=ttyS0 tsc=unstable" {
		t.Errorf("cmdline %q", got)
	}
}

func TestDomainXMLRejectsEmptyResources(t *testing.T) {
	c := testConfig()
	c.Spec.CPUs = 0
	if _, err := domainXML(c); err == nil {
		t.Error("no error for 0 cpus")
	}
}

func TestMetadataRejectsOtherNamespaces(t *testing.T) {
	if _, err := parseMetadata(`<vm xmlns="https://example.com/other" name="x" dir="/d"/>`); err == nil {
		t.Error("parsed metadata of another namespace")
	}
	if _, err := parseMetadata(`<c:vm xmlns:c="` + MetadataNS + `" name="x"/>`); err == nil {
		t.Error("parsed metadata without a dir")
	}
	m, err := parseMetadata(`<other:vm xmlns:other="` + MetadataNS + `" name="x" dir="/d"/>`)
	if err != nil || m.VM != "x" || m.Dir != "/d" {
		t.Errorf("prefix must not matter: %+v %v", m, err)
	}
	// virDomainGetMetadata, asked for carrel's namespace, strips it.
	m, err = parseMetadata(`<vm name="x" dir="/d"/>`)
	if err != nil || m.VM != "x" || m.Dir != "/d" {
		t.Errorf("as virDomainGetMetadata returns it: %+v %v", m, err)
	}
}

func TestLiveCID(t *testing.T) {
	live := `<domain type='kvm' id='4'><name>carrel-demo</name><devices>
	  <vsock model='virtio'><cid auto='yes' address='5'/><alias name='vsock0'/></vsock>
	</devices></domain>`
	if cid, err := liveCID(live); err != nil || cid != 5 {
		t.Errorf("cid %d, %v", cid, err)
	}
	if cid, err := liveCID(`<domain><name>x</name><devices/></domain>`); err != nil || cid != 0 {
		t.Errorf("no vsock: cid %d, %v", cid, err)
	}
	if _, err := liveCID(`<domain><name>x</name><devices><vsock><cid auto='yes' address='2'/></vsock></devices></domain>`); err == nil {
		t.Error("accepted the host's cid")
	}
}

func TestDACUser(t *testing.T) {
	caps := `<capabilities><host>
	  <secmodel><model>none</model><doi>0</doi></secmodel>
	  <secmodel><model>dac</model><doi>0</doi>
	    <baselabel type='kvm'>+64055:+994</baselabel>
	    <baselabel type='qemu'>+64055:+64055</baselabel>
	  </secmodel>
	</host></capabilities>`
	uid, gid, label, err := dacUser(caps, "kvm")
	if err != nil || uid != 64055 || gid != 994 || label != "+64055:+994" {
		t.Errorf("kvm: %d %d %q %v", uid, gid, label, err)
	}
	if _, _, _, err := dacUser(caps, "xen"); err == nil {
		t.Error("no error for a type without a label")
	}
	for _, bad := range []string{"libvirt-qemu:kvm", "+1", "+a:+b", "+-1:+0"} {
		if _, _, err := parseDACLabel(bad); err == nil {
			t.Errorf("parsed %q", bad)
		}
	}
}

// TestStartChecksGPUs: a VM whose GPUs the host cannot give (here: no
// IOMMU) is refused before libvirtd is asked anything (none answers here).
// Real passthrough is not exercised: this machine has no GPU and no IOMMU.
func TestStartChecksGPUs(t *testing.T) {
	fake := gputest.New(t, "nvidia", "snd_hda_intel", "pcieport", "vfio-pci")
	fake.Add(gputest.WithoutIOMMU(gputest.NVIDIAWithAudio())...)
	d, err := New(Config{URI: "qemu:///system?socket=/nonexistent", GPUs: gpu.New(gpu.Config{Sysfs: fake.Root, Write: fake.Write, PCIIDs: []string{}})})
	if err != nil {
		t.Fatal(err)
	}
	spec := testConfig().Spec
	spec.GPUs = []string{gputest.NVIDIAGPU}
	if _, err := d.Start(context.Background(), spec); err == nil || !strings.Contains(err.Error(), gputest.NVIDIAGPU) || !strings.Contains(strings.ToLower(err.Error()), "iommu") {
		t.Errorf("start with a gpu on a host without an iommu: %v", err)
	}
}

// TestDomainHostdevs: a GPU goes into the domain as managed PCI hostdevs,
// one for each endpoint of its slot, and the domain parses back.
func TestDomainHostdevs(t *testing.T) {
	fake := gputest.New(t, "nvidia", "snd_hda_intel", "pcieport", "vfio-pci")
	fake.Add(gputest.NVIDIAWithAudio()...)
	devs, err := gpu.New(gpu.Config{Sysfs: fake.Root, Write: fake.Write, PCIIDs: []string{}}).Hostdevs([]string{gputest.NVIDIAGPU})
	if err != nil {
		t.Fatal(err)
	}
	c := testConfig()
	c.Hostdevs = devs
	x, err := domainXML(c)
	if err != nil {
		t.Fatal(err)
	}
	var dom libvirtxml.Domain
	if err := dom.Unmarshal(x); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, h := range dom.Devices.Hostdevs {
		if h.Managed != "yes" || h.SubsysPCI == nil || h.SubsysPCI.Source == nil || h.SubsysPCI.Source.Address == nil {
			t.Fatalf("hostdev %+v", h)
		}
		a := h.SubsysPCI.Source.Address
		got = append(got, fmt.Sprintf("%04x:%02x:%02x.%x", *a.Domain, *a.Bus, *a.Slot, *a.Function))
	}
	if want := []string{gputest.NVIDIAGPU, gputest.NVIDIAAudio}; strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("hostdevs %v, want %v", got, want)
	}
}
