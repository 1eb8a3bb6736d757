package libvirt

import (
	"bytes"
	"encoding/binary"
	"strings"
	"testing"

	"libvirt.org/go/libvirtxml"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/driver"
)

// image is a save image of xml with cookie, followed by stream.
func image(t testing.TB, xml string, cookie []byte, stream string) []byte {
	t.Helper()
	h, err := saveImage{Cookie: cookie, WasRunning: 1}.header(xml)
	if err != nil {
		t.Fatal(err)
	}
	return append(h, stream...)
}

func TestSaveImageRoundTrip(t *testing.T) {
	b := image(t, "<domain/>", []byte("<cookie/>"), "QEVM-stream")
	img, err := readSaveImage(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	if img.XML != "<domain/>" || string(img.Cookie) != "<cookie/>" || img.WasRunning != 1 || string(b[img.Stream:]) != "QEVM-stream" {
		t.Errorf("read back %+v, stream %q", img, b[img.Stream:])
	}
	// Without a cookie.
	b = image(t, "<domain/>", nil, "QEVM")
	if img, err := readSaveImage(bytes.NewReader(b)); err != nil || img.Cookie != nil || string(b[img.Stream:]) != "QEVM" {
		t.Errorf("no cookie: %+v, %v", img, err)
	}
	if _, err := (saveImage{}).header("a\x00b"); err == nil {
		t.Error("an XML with a NUL was written")
	}
}

func TestSaveImageRejects(t *testing.T) {
	good := image(t, "<domain/>", []byte("<cookie/>"), "QEVM")
	le := binary.LittleEndian
	for name, change := range map[string]func([]byte) []byte{
		"unfinished": func(b []byte) []byte { copy(b, "LibvirtQemudPart"); return b },
		"version":    func(b []byte) []byte { le.PutUint32(b[16:], 3); return b },
		"huge data":  func(b []byte) []byte { le.PutUint32(b[20:], maxSaveData+1); return b },
		"no data":    func(b []byte) []byte { le.PutUint32(b[20:], 0); return b },
		"compressed": func(b []byte) []byte { le.PutUint32(b[28:], 1); return b },
		"cookie out": func(b []byte) []byte { le.PutUint32(b[32:], 1<<20); return b },
		"short":      func(b []byte) []byte { return b[:60] },
		"cut data":   func(b []byte) []byte { return b[:saveHeaderBytes+4] },
		"no xml":     func(b []byte) []byte { b[saveHeaderBytes] = 0; return b },
	} {
		b := change(bytes.Clone(good))
		if img, err := readSaveImage(bytes.NewReader(b)); err == nil {
			t.Errorf("%s: read as %+v", name, img)
		}
	}
}

// TestRestoreXML: the saved domain becomes the new VM's (name, UUID,
// metadata, files, sockets, a new CID, no memory limit), with its devices
// and their addresses as saved, and the header's XML differs from the
// saved one only in name and UUID.
func TestRestoreXML(t *testing.T) {
	parent := testConfig()
	parent.Spec.CID = 7
	parent.Spec.Disks = []driver.Disk{
		{Path: "/img/root", Format: driver.FormatRaw, ReadOnly: true, Serial: "carrel-root"},
		{Path: "/vms/demo/state.qcow2", Format: driver.FormatQCOW2, Backing: "/tpl.raw", Serial: "carrel-state"},
	}
	saved := parse(t, parent)
	saved.Devices.Disks[1].Address = &libvirtxml.DomainAddress{PCI: &libvirtxml.DomainAddressPCI{Bus: new(uint)}}
	saved.Devices.VSock.CID.Address = "7"
	saved.MemoryTune = &libvirtxml.DomainMemoryTune{HardLimit: &libvirtxml.DomainMemoryTuneLimit{Value: 1}}
	saved.Devices.Emulator = "/somewhere/qemu"
	savedXML, err := saved.Marshal()
	if err != nil {
		t.Fatal(err)
	}

	fork := testConfig()
	fork.Spec.Name, fork.Spec.Dir = "fork", "/vms/fork"
	fork.Name, fork.UUID = "carrel-fork", "0b7e2f0e-8a4c-4c5e-9a0e-2f4a7c9d1e00"
	fork.AgentSocket, fork.DataSocket, fork.ConsoleSocket = "/vms/fork/agent.sock", "/vms/fork/data.sock", "/vms/fork/console.sock"
	fork.Spec.Disks = []driver.Disk{
		{Path: "/img/root", Format: driver.FormatRaw, ReadOnly: true, Serial: "carrel-root"},
		{Path: "/vms/fork/state-2.qcow2", Format: driver.FormatQCOW2, Backing: "/tpl.raw", Layers: []string{"/vms/demo/state.qcow2"}, Serial: "carrel-state"},
	}
	header, full, data, err := restoreXML(savedXML, fork)
	if err != nil {
		t.Fatal(err)
	}
	var h, d libvirtxml.Domain
	if err := h.Unmarshal(header); err != nil {
		t.Fatal(err)
	}
	if err := d.Unmarshal(full); err != nil {
		t.Fatal(err)
	}
	if h.Name != fork.Name || h.UUID != fork.UUID || h.Devices.Disks[1].Source.File.File != "/vms/demo/state.qcow2" || h.MemoryTune != nil {
		t.Errorf("header xml:\n%s", header)
	}
	if d.Name != fork.Name || d.UUID != fork.UUID || !strings.Contains(d.Metadata.XML, `dir="/vms/fork"`) || d.MemoryTune != nil {
		t.Errorf("full xml:\n%s", full)
	}
	disk := d.Devices.Disks[1]
	chain := []string{disk.Source.File.File}
	for b := disk.BackingStore; b != nil && b.Source != nil && b.Source.File != nil; b = b.BackingStore {
		chain = append(chain, b.Format.Type+":"+b.Source.File.File)
	}
	if strings.Join(chain, " ") != "/vms/fork/state-2.qcow2 qcow2:/vms/demo/state.qcow2 raw:/tpl.raw" || disk.Address == nil {
		t.Errorf("disk chain %v, address %+v", chain, disk.Address)
	}
	if d.Devices.Channels[0].Source.UNIX.Path != fork.AgentSocket || d.Devices.Channels[1].Source.UNIX.Path != fork.DataSocket ||
		d.Devices.Serials[0].Source.UNIX.Path != fork.ConsoleSocket || !data {
		t.Errorf("sockets: %+v %+v %+v, data port %v", d.Devices.Channels[0].Source.UNIX, d.Devices.Channels[1].Source.UNIX, d.Devices.Serials[0].Source.UNIX, data)
	}
	if d.Devices.VSock.CID.Auto != "yes" || d.Devices.VSock.CID.Address != "" {
		t.Errorf("vsock cid: %+v", d.Devices.VSock.CID)
	}

	// A saved domain with more than carrel's domains ever have is refused.
	odd := *saved
	odd.Devices = &libvirtxml.DomainDeviceList{}
	*odd.Devices = *saved.Devices
	odd.Devices.Interfaces = []libvirtxml.DomainInterface{{}}
	if x, err := odd.Marshal(); err != nil {
		t.Fatal(err)
	} else if _, _, _, err := restoreXML(x, fork); err == nil {
		t.Error("restored a saved domain with a network interface")
	}
	if strings.Contains(full, "<emulator>") {
		t.Errorf("the saved emulator was kept:\n%s", full)
	}

	// A VM whose disks are not the saved domain's cannot take its state.
	other := fork
	other.Spec.Disks = fork.Spec.Disks[:1]
	if _, _, _, err := restoreXML(savedXML, other); err == nil {
		t.Error("restored into a vm with fewer disks")
	}
	other.Spec.Disks = []driver.Disk{fork.Spec.Disks[0], {Path: "/x", Serial: "carrel-other"}}
	if _, _, _, err := restoreXML(savedXML, other); err == nil {
		t.Error("restored into a vm with another disk")
	}
}

// TestRestoreXMLKeepsTheSavedPorts: a domain saved before the data port
// existed is restored without one, whatever the VM's spec says, since
// QEMU's stream fits only the saved ports; two data ports are refused.
func TestRestoreXMLKeepsTheSavedPorts(t *testing.T) {
	old := testConfig()
	old.Spec.NoDataPort = true
	saved := parse(t, old)
	savedXML, err := saved.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	_, full, data, err := restoreXML(savedXML, testConfig())
	if err != nil {
		t.Fatal(err)
	}
	var d libvirtxml.Domain
	if err := d.Unmarshal(full); err != nil {
		t.Fatal(err)
	}
	if data || len(d.Devices.Channels) != 1 || strings.Contains(full, protocol.DataPortName) {
		t.Errorf("restored a data port (%v) the saved domain lacks:\n%s", data, full)
	}

	saved.Devices.Channels = append(saved.Devices.Channels, virtioChannel("/a", protocol.DataPortName), virtioChannel("/b", protocol.DataPortName))
	if x, err := saved.Marshal(); err != nil {
		t.Fatal(err)
	} else if _, _, _, err := restoreXML(x, testConfig()); err == nil {
		t.Error("restored a saved domain with two data ports")
	}
}

// FuzzReadSaveImage: whatever a file holds, the reader answers without
// panicking, and what it accepts lies within the file.
func FuzzReadSaveImage(f *testing.F) {
	f.Add(image(f, "<domain/>", []byte("<cookie/>"), "QEVM"))
	f.Add(image(f, "<domain/>", nil, ""))
	f.Add([]byte(saveMagic))
	f.Fuzz(func(t *testing.T, b []byte) {
		img, err := readSaveImage(bytes.NewReader(b))
		if err != nil {
			return
		}
		if img.Stream > int64(len(b)) || len(img.XML) == 0 || len(img.XML)+len(img.Cookie) > maxSaveData {
			t.Errorf("accepted %+v from %d bytes", img, len(b))
		}
	})
}
