package libvirt

import (
	"encoding/xml"
	"fmt"
	"strconv"
	"strings"

	lv "github.com/digitalocean/go-libvirt"
	"libvirt.org/go/libvirtxml"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/accel"
	"github.com/carrel-os/carrel/supervisor/driver"
)

// MetadataNS is the XML namespace of carrel's element in a domain's
// <metadata>. A domain without it is not carrel's, and carreld never
// touches it.
const MetadataNS = "https://github.com/carrel-os/carrel/xmlns/libvirt/domain/1"

// metadataPrefix is the namespace prefix libvirt shows (virsh metadata
// --key).
const metadataPrefix = "carrel"

// DomainPrefix starts the name of every domain carreld creates.
const DomainPrefix = "carrel-"

// DomainName is the libvirt domain name of a VM.
func DomainName(vm string) string { return DomainPrefix + vm }

// metadata marks a domain as carrel's and says which VM directory it
// belongs to, so that Sweep and Adopt only touch their own domain.
type metadata struct {
	VM  string
	Dir string
}

// metadataOut is metadata as written: encoding/xml cannot choose a
// namespace prefix, so the prefix is spelled out in the element name.
type metadataOut struct {
	XMLName xml.Name `xml:"carrel:vm"`
	NS      string   `xml:"xmlns:carrel,attr"`
	VM      string   `xml:"name,attr"`
	Dir     string   `xml:"dir,attr"`
}

// metadataIn is metadata as read back: in carrel's namespace in a domain's
// XML, in none from virDomainGetMetadata (which matched the namespace).
type metadataIn struct {
	XMLName xml.Name `xml:"vm"`
	VM      string   `xml:"name,attr"`
	Dir     string   `xml:"dir,attr"`
}

func (m metadata) marshal() (string, error) {
	b, err := xml.Marshal(metadataOut{NS: MetadataNS, VM: m.VM, Dir: m.Dir})
	if err != nil {
		return "", fmt.Errorf("marshal domain metadata: %w", err)
	}
	return string(b), nil
}

func parseMetadata(s string) (metadata, error) {
	var in metadataIn
	if err := xml.Unmarshal([]byte(s), &in); err != nil {
		return metadata{}, fmt.Errorf("parse carrel domain metadata: %w", err)
	}
	if ns := in.XMLName.Space; ns != "" && ns != MetadataNS {
		return metadata{}, fmt.Errorf("domain metadata element is in namespace %q, not carrel's", ns)
	}
	if in.VM == "" || in.Dir == "" {
		return metadata{}, fmt.Errorf("carrel domain metadata %q lacks name or dir", s)
	}
	return metadata{VM: in.VM, Dir: in.Dir}, nil
}

// domainConfig is everything a domain's XML is built from.
type domainConfig struct {
	Spec driver.Spec
	Name string
	UUID string
	// Accelerator is accel.KVM or accel.TCG.
	Accelerator string
	// User is the "+uid:+gid" QEMU runs as (libvirt's DAC base label).
	User        string
	AgentSocket string
	// DataSocket is the data port's; the port is left out when
	// Spec.NoDataPort.
	DataSocket    string
	ConsoleSocket string
	// Hostdevs are the VM's GPUs (and the rest of their IOMMU groups'
	// endpoints), as managed VFIO hostdevs.
	Hostdevs []libvirtxml.DomainHostdev
}

// domainXML builds the domain: direct kernel boot, a host limit on CPU
// time, no NIC, the spec's disks, the agent's and the data virtio-serial
// ports and the serial console as unix sockets that libvirtd creates (it
// binds them itself and hands QEMU the descriptors, so QEMU needs no
// access to the VM's directory), a vsock device with a CID libvirt picks
// when the spec asks for vsock, and carrel's metadata.
//
// QEMU runs as libvirt's unprivileged user, but with relabel='no': libvirt
// must not chown the kernel and initrd, which are shared, content-addressed
// files of carreld's image store, to the user a compromised QEMU runs as.
// carreld grants that user read access instead (see grantRead).
func domainXML(c domainConfig) (string, error) {
	if c.Spec.CPUs == 0 || c.Spec.MemoryBytes == 0 {
		return "", fmt.Errorf("domain %q: cpus and memory must be set", c.Name)
	}
	meta, err := metadata{VM: c.Spec.Name, Dir: c.Spec.Dir}.marshal()
	if err != nil {
		return "", err
	}
	// The host's own CPU under KVM; under TCG, QEMU's "max" model without
	// the features TCG runs slowly (accel.TCGHiddenFeatures).
	typ, cpu := "kvm", &libvirtxml.DomainCPU{Mode: "host-passthrough"}
	if c.Accelerator != accel.KVM {
		typ, cpu = "qemu", &libvirtxml.DomainCPU{Mode: "maximum"}
		for _, f := range accel.TCGHiddenFeatures {
			cpu.Features = append(cpu.Features, libvirtxml.DomainCPUFeature{Policy: "disable", Name: f})
		}
	}
	port0 := uint(0)
	d := libvirtxml.Domain{
		Type:     typ,
		Name:     c.Name,
		UUID:     c.UUID,
		Metadata: &libvirtxml.DomainMetadata{XML: meta},
		Memory:   &libvirtxml.DomainMemory{Value: uint(c.Spec.MemoryBytes >> 10), Unit: "KiB"},
		VCPU:     &libvirtxml.DomainVCPU{Placement: "static", Value: uint(c.Spec.CPUs)},
		// CPU time for the vCPUs and one CPU more, the qemu driver's
		// numbers, which libvirt sets on the domain's cgroup. The global
		// quota bounds the whole domain (vCPU, emulator and I/O threads),
		// as cpu.max does in the qemu driver; <quota> would bound each
		// vCPU. The memory limit is not here but set on the paused domain
		// (memoryLimit).
		CPUTune: &libvirtxml.DomainCPUTune{
			GlobalPeriod: &libvirtxml.DomainCPUTunePeriod{Value: driver.CPUPeriod},
			GlobalQuota:  &libvirtxml.DomainCPUTuneQuota{Value: int64(driver.CPUQuota(c.Spec.CPUs))},
		},
		OS: &libvirtxml.DomainOS{
			// q35, as the qemu driver picks under TCG: it has the HPET and
			// ACPI PM timer the kernel needs when TSC calibration fails.
			// libvirt does not support microvm.
			Type:    &libvirtxml.DomainOSType{Arch: "x86_64", Machine: "q35", Type: "hvm"},
			Kernel:  c.Spec.Kernel,
			Initrd:  c.Spec.Initrd,
			Cmdline: cmdline(c.Spec.Cmdline, c.Accelerator),
		},
		// ACPI lets the guest power off (the agent's shutdown).
		Features: &libvirtxml.DomainFeatureList{ACPI: &libvirtxml.DomainFeature{}, APIC: &libvirtxml.DomainFeatureAPIC{}},
		CPU:      cpu,
		Clock:    &libvirtxml.DomainClock{Offset: "utc"},
		// Whatever ends the guest ends the domain (QEMU's -no-reboot): a
		// transient domain then vanishes, and Wait returns.
		OnPoweroff: "destroy",
		OnReboot:   "destroy",
		OnCrash:    "destroy",
		Devices: &libvirtxml.DomainDeviceList{
			Controllers: []libvirtxml.DomainController{{Type: "usb", Model: "none"}},
			Serials: []libvirtxml.DomainSerial{{
				Source: &libvirtxml.DomainChardevSource{UNIX: &libvirtxml.DomainChardevSourceUNIX{Mode: "bind", Path: c.ConsoleSocket}},
				Target: &libvirtxml.DomainSerialTarget{Port: &port0},
			}},
			Channels:   []libvirtxml.DomainChannel{virtioChannel(c.AgentSocket, protocol.SerialPortName)},
			MemBalloon: &libvirtxml.DomainMemBalloon{Model: "none"},
		},
		SecLabel: []libvirtxml.DomainSecLabel{{Type: "static", Model: "dac", Relabel: "no", Label: c.User}},
	}
	if !c.Spec.NoDataPort {
		d.Devices.Channels = append(d.Devices.Channels, virtioChannel(c.DataSocket, protocol.DataPortName))
	}
	if c.Spec.CID != 0 {
		d.Devices.VSock = &libvirtxml.DomainVSock{Model: "virtio", CID: &libvirtxml.DomainVSockCID{Auto: "yes"}}
	}
	for i, disk := range c.Spec.Disks {
		d.Devices.Disks = append(d.Devices.Disks, domainDisk(disk, i))
	}
	d.Devices.Hostdevs = c.Hostdevs
	s, err := d.Marshal()
	if err != nil {
		return "", fmt.Errorf("marshal domain %q: %w", c.Name, err)
	}
	return s, nil
}

// virtioChannel is a virtio-serial port named name, on a unix socket that
// libvirtd binds at path.
func virtioChannel(path, name string) libvirtxml.DomainChannel {
	return libvirtxml.DomainChannel{
		Source: &libvirtxml.DomainChardevSource{UNIX: &libvirtxml.DomainChardevSourceUNIX{Mode: "bind", Path: path}},
		Target: &libvirtxml.DomainChannelTarget{VirtIO: &libvirtxml.DomainChannelTargetVirtIO{Name: name}},
	}
}

// domainDisk is the i-th disk of the VM. A qcow2 disk's chain is spelled
// out (its frozen qcow2 layers, then its raw backing file, then nothing),
// so that libvirt probes no formats. The guest finds each disk by its
// serial.
func domainDisk(disk driver.Disk, i int) libvirtxml.DomainDisk {
	d := libvirtxml.DomainDisk{
		Device: "disk",
		Driver: &libvirtxml.DomainDiskDriver{Name: "qemu", Type: disk.Format},
		Target: &libvirtxml.DomainDiskTarget{Dev: "vd" + string(rune('a'+i)), Bus: "virtio"},
		Serial: disk.Serial,
	}
	if disk.ReadOnly {
		d.ReadOnly = &libvirtxml.DomainDiskReadOnly{}
	} else {
		d.Driver.Discard = "unmap"
	}
	setDiskFiles(&d, disk)
	return d
}

// setDiskFiles points d at disk's file and spells out its backing chain:
// its frozen layers, then its backing file.
func setDiskFiles(d *libvirtxml.DomainDisk, disk driver.Disk) {
	d.Source = &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: disk.Path}}
	d.BackingStore = nil
	if disk.Backing == "" {
		return
	}
	// An empty element ends the chain: the backing file has none.
	chain := &libvirtxml.DomainDiskBackingStore{
		Format:       &libvirtxml.DomainDiskFormat{Type: driver.FormatRaw},
		Source:       &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: disk.Backing}},
		BackingStore: &libvirtxml.DomainDiskBackingStore{},
	}
	for i := len(disk.Layers) - 1; i >= 0; i-- {
		chain = &libvirtxml.DomainDiskBackingStore{
			Format:       &libvirtxml.DomainDiskFormat{Type: driver.FormatQCOW2},
			Source:       &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: disk.Layers[i]}},
			BackingStore: chain,
		}
	}
	d.BackingStore = chain
}

// memoryLimit is the host's limit on the memory of a domain's QEMU, the
// qemu driver's (the guest's RAM and QEMU's overhead), as the hard_limit
// parameter of virDomainSetMemoryParameters, in KiB. libvirt writes it to
// the domain's memory cgroup.
//
// It is set on the running, paused domain rather than as <memtune> in its
// XML: from the XML, libvirt (9.0 at least) also raises QEMU's
// RLIMIT_MEMLOCK to the hard limit before exec, which lets QEMU lock that
// much memory and fails outright where libvirtd lacks CAP_SYS_RESOURCE
// (in containers, such as the build and CI machines). Set live, only the
// cgroup changes.
func memoryLimit(spec driver.Spec, acc string) lv.TypedParam {
	return lv.TypedParam{
		Field: lv.DomainMemoryHardLimit,
		Value: *lv.NewTypedParamValueUllong(driver.HostMemoryLimit(spec.MemoryBytes, acc) >> 10),
	}
}

// cmdline adds what the guest kernel needs under this accelerator.
func cmdline(base, acc string) string {
	if acc == accel.TCG && !hasParam(base, "tsc") {
		// As in the qemu driver: under TCG the vCPUs' TSCs agree, but with
		// two or more vCPUs the kernel cannot prove it and falls back to the
		// HPET, which turns every clock read into an emulated MMIO read.
		return strings.TrimSpace(base + " tsc=reliable")
	}
	return base
}

// hasParam reports whether the kernel command line sets name.
func hasParam(cmdline, name string) bool {
	for _, f := range strings.Fields(cmdline) {
		if k, _, _ := strings.Cut(f, "="); k == name {
			return true
		}
	}
	return false
}

// liveCID reads the vsock CID libvirt assigned from a running domain's
// XML; 0 when it has no vsock device.
func liveCID(domXML string) (uint32, error) {
	var d libvirtxml.Domain
	if err := d.Unmarshal(domXML); err != nil {
		return 0, fmt.Errorf("parse live domain xml: %w", err)
	}
	if d.Devices == nil || d.Devices.VSock == nil || d.Devices.VSock.CID == nil {
		return 0, nil
	}
	cid, err := strconv.ParseUint(d.Devices.VSock.CID.Address, 10, 32)
	if err != nil || cid < 3 {
		return 0, fmt.Errorf("domain %q has vsock cid %q", d.Name, d.Devices.VSock.CID.Address)
	}
	return uint32(cid), nil
}

// dacUser returns the "+uid:+gid" libvirt runs domains of type typ as,
// from the host capabilities (qemu.conf's user and group).
func dacUser(capsXML, typ string) (uid, gid int, label string, err error) {
	var caps libvirtxml.Caps
	if err := caps.Unmarshal(capsXML); err != nil {
		return 0, 0, "", fmt.Errorf("parse libvirt capabilities: %w", err)
	}
	for _, m := range caps.Host.SecModel {
		if m.Name != "dac" {
			continue
		}
		for _, l := range m.Labels {
			if l.Type == typ {
				uid, gid, err := parseDACLabel(l.Value)
				return uid, gid, l.Value, err
			}
		}
	}
	return 0, 0, "", fmt.Errorf("libvirt reports no DAC base label for %s domains", typ)
}

// parseDACLabel parses "+uid:+gid".
func parseDACLabel(s string) (uid, gid int, err error) {
	u, g, ok := strings.Cut(s, ":")
	if ok && strings.HasPrefix(u, "+") && strings.HasPrefix(g, "+") {
		uid, uerr := strconv.Atoi(u[1:])
		gid, gerr := strconv.Atoi(g[1:])
		if uerr == nil && gerr == nil && uid >= 0 && gid >= 0 {
			return uid, gid, nil
		}
	}
	return 0, 0, fmt.Errorf("libvirt DAC label %q is not +uid:+gid", s)
}
