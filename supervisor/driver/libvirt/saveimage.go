package libvirt

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"

	"libvirt.org/go/libvirtxml"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/driver"
)

// libvirt keeps a domain's saved state (a save, or a snapshot's external
// memory) in a save image, whose layout is fixed by libvirt's
// src/qemu/qemu_saveimage.h: a header, then dataLen bytes holding the
// domain's XML and a NUL, the migration cookie and a NUL from
// cookieOffset, and zeros; then QEMU's migration stream.
//
// A restore must keep the saved domain's name and UUID: libvirt refuses
// XML that names another domain. But every start of a carrel VM is a new
// transient domain with a new UUID, and a fork is another VM's domain. So
// the driver writes each restore an image of its own: the header and XML
// under the new name and UUID, then QEMU's stream as saved. libvirt then
// checks the new VM's full XML (its files and sockets) against that XML,
// as for any restore, so that the devices QEMU's stream describes are the
// devices the new domain has.
const (
	saveMagic   = "LibvirtQemudSave"
	saveVersion = 2
	// saveHeaderBytes is the magic and 19 little-endian uint32s: version,
	// dataLen, wasRunning, compressed, cookieOffset and 14 unused.
	saveHeaderBytes = 92
	// maxSaveData bounds the XML and cookie carreld reads: libvirt's are
	// a few KiB, padded to 64 KiB.
	maxSaveData = 16 << 20
)

// saveImage is what carreld reads of a save image.
type saveImage struct {
	XML        string
	Cookie     []byte // without its NUL; nil when there is none
	WasRunning uint32
	// Stream is the offset of QEMU's migration stream.
	Stream int64
}

// readSaveImage reads the header and XML of the save image r. It trusts
// nothing in it: every length is bounded by maxSaveData and the data read.
func readSaveImage(r io.ReaderAt) (saveImage, error) {
	var h [saveHeaderBytes]byte
	if _, err := r.ReadAt(h[:], 0); err != nil {
		return saveImage{}, fmt.Errorf("libvirt save image header: %w", err)
	}
	if string(h[:len(saveMagic)]) != saveMagic {
		return saveImage{}, errors.New("not a complete libvirt save image")
	}
	le := binary.LittleEndian
	version, dataLen, wasRunning, compressed, cookieAt := le.Uint32(h[16:]), le.Uint32(h[20:]), le.Uint32(h[24:]), le.Uint32(h[28:]), le.Uint32(h[32:])
	switch {
	case version != saveVersion:
		return saveImage{}, fmt.Errorf("libvirt save image version %d, want %d", version, saveVersion)
	case compressed != 0:
		return saveImage{}, fmt.Errorf("libvirt save image is compressed (format %d): carrel reads only raw ones", compressed)
	case dataLen == 0 || dataLen > maxSaveData:
		return saveImage{}, fmt.Errorf("libvirt save image claims %d bytes of XML", dataLen)
	case cookieAt >= dataLen:
		return saveImage{}, fmt.Errorf("libvirt save image's cookie at %d lies outside its %d bytes of data", cookieAt, dataLen)
	}
	data := make([]byte, dataLen)
	if _, err := r.ReadAt(data, saveHeaderBytes); err != nil {
		return saveImage{}, fmt.Errorf("libvirt save image data: %w", err)
	}
	xmlPart := data
	if cookieAt != 0 {
		xmlPart = data[:cookieAt]
	}
	end := bytes.IndexByte(xmlPart, 0)
	if end <= 0 {
		return saveImage{}, errors.New("libvirt save image has no domain XML")
	}
	img := saveImage{XML: string(xmlPart[:end]), WasRunning: wasRunning, Stream: saveHeaderBytes + int64(dataLen)}
	if cookieAt != 0 {
		c := data[cookieAt:]
		n := bytes.IndexByte(c, 0)
		if n < 0 {
			return saveImage{}, errors.New("libvirt save image's cookie is not terminated")
		}
		img.Cookie = c[:n]
	}
	return img, nil
}

// header returns the header and data of a save image of the domain xml,
// with img's cookie and running state; QEMU's stream follows them.
func (img saveImage) header(xml string) ([]byte, error) {
	if strings.IndexByte(xml, 0) >= 0 {
		return nil, errors.New("domain XML holds a NUL")
	}
	data := append([]byte(xml), 0)
	cookieAt := 0
	if img.Cookie != nil {
		cookieAt = len(data)
		data = append(append(data, img.Cookie...), 0)
	}
	if len(data) > maxSaveData {
		return nil, fmt.Errorf("domain XML and cookie of %d bytes, over %d", len(data), maxSaveData)
	}
	b := make([]byte, saveHeaderBytes, saveHeaderBytes+len(data))
	copy(b, saveMagic)
	le := binary.LittleEndian
	le.PutUint32(b[16:], saveVersion)
	le.PutUint32(b[20:], uint32(len(data)))
	le.PutUint32(b[24:], img.WasRunning)
	le.PutUint32(b[32:], uint32(cookieAt))
	return append(b, data...), nil
}

// restoreXML makes the XML of a saved domain the new VM's. It returns the
// XML for the image's header, the saved one under the new name and UUID,
// and the new domain's full XML, which libvirt checks against it: its
// metadata, kernel and initrd, its disks' files and backing chains (by
// serial), its sockets, a new vsock CID and QEMU's user; it drops the
// memory limit, which Start sets live. The devices, their
// addresses and the CPU stay as saved: QEMU's stream fits only them. So
// the VM has a data port when the saved domain had one, which data says.
func restoreXML(saved string, c domainConfig) (header, full string, data bool, err error) {
	var d libvirtxml.Domain
	if err := d.Unmarshal(saved); err != nil {
		return "", "", false, fmt.Errorf("parse the saved domain: %w", err)
	}
	if d.Devices == nil || d.OS == nil {
		return "", "", false, errors.New("the saved domain has no devices or os")
	}
	// None of carrel's domains has these; the state file is root's and
	// hashed, but a domain from it gets no more than domainXML gives.
	if len(d.Devices.Hostdevs) > 0 || len(d.Devices.Filesystems) > 0 || len(d.Devices.Interfaces) > 0 || d.QEMUCommandline != nil {
		return "", "", false, errors.New("the saved domain has host devices, file systems, network interfaces or qemu arguments, which carrel's domains never have")
	}
	// libvirt's own QEMU for the domain type, as at a start.
	d.Devices.Emulator = ""
	d.Name, d.UUID = c.Name, c.UUID
	// The memory limit the saved domain had live: Start sets it on the
	// restored domain as on a new one (see memoryLimit).
	d.MemoryTune = nil
	if header, err = d.Marshal(); err != nil {
		return "", "", false, err
	}
	meta, err := metadata{VM: c.Spec.Name, Dir: c.Spec.Dir}.marshal()
	if err != nil {
		return "", "", false, err
	}
	d.Metadata = &libvirtxml.DomainMetadata{XML: meta}
	d.OS.Kernel, d.OS.Initrd = c.Spec.Kernel, c.Spec.Initrd
	if len(d.Devices.Disks) != len(c.Spec.Disks) {
		return "", "", false, fmt.Errorf("the saved domain has %d disks, the vm %d", len(d.Devices.Disks), len(c.Spec.Disks))
	}
	for i := range d.Devices.Disks {
		disk := &d.Devices.Disks[i]
		j := findDisk(c.Spec.Disks, disk.Serial)
		if j < 0 {
			return "", "", false, fmt.Errorf("the saved domain has a disk %q the vm lacks", disk.Serial)
		}
		setDiskFiles(disk, c.Spec.Disks[j])
	}
	unix := func(path string) *libvirtxml.DomainChardevSource {
		return &libvirtxml.DomainChardevSource{UNIX: &libvirtxml.DomainChardevSourceUNIX{Mode: "bind", Path: path}}
	}
	agent, dataPorts := 0, 0
	for i := range d.Devices.Channels {
		ch := &d.Devices.Channels[i]
		if ch.Target == nil || ch.Target.VirtIO == nil {
			continue
		}
		switch ch.Target.VirtIO.Name {
		case protocol.SerialPortName:
			ch.Source = unix(c.AgentSocket)
			agent++
		case protocol.DataPortName:
			ch.Source = unix(c.DataSocket)
			dataPorts++
		}
	}
	for i := range d.Devices.Serials {
		d.Devices.Serials[i].Source = unix(c.ConsoleSocket)
	}
	for i := range d.Devices.Consoles {
		d.Devices.Consoles[i].Source = unix(c.ConsoleSocket)
	}
	if agent != 1 || dataPorts > 1 || len(d.Devices.Serials) != 1 {
		return "", "", false, fmt.Errorf("the saved domain has %d agent channels, %d data channels and %d serial ports, want one agent channel and serial port and at most one data channel", agent, dataPorts, len(d.Devices.Serials))
	}
	if d.Devices.VSock != nil {
		d.Devices.VSock.CID = &libvirtxml.DomainVSockCID{Auto: "yes"}
	}
	for i := range d.SecLabel {
		if d.SecLabel[i].Model == "dac" {
			d.SecLabel[i].Label = c.User
		}
	}
	if full, err = d.Marshal(); err != nil {
		return "", "", false, err
	}
	return header, full, dataPorts == 1, nil
}

// findDisk is the index of the disk with serial in disks, or -1.
func findDisk(disks []driver.Disk, serial string) int {
	for i, d := range disks {
		if d.Serial == serial {
			return i
		}
	}
	return -1
}
