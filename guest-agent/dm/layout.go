//go:build linux

package dm

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"

	"golang.org/x/sys/unix"
)

// The ioctl buffer, as include/uapi/linux/dm-ioctl.h defines it. Every
// command passes one buffer that starts with struct dm_ioctl:
//
//	off  size  field
//	  0    12  version[3]    in: {4, 0, 0}; the kernel writes back its own
//	 12     4  data_size     in: length of the whole buffer; out: bytes used
//	 16     4  data_start    offset of the payload from the buffer's start
//	 20     4  target_count  in: targets in a table load; out: in the table
//	 24     4  open_count    out
//	 28     4  flags         in/out, DM_*_FLAG
//	 32     4  event_nr      in: udev cookie (we send 0); out: event number
//	 36     4  padding
//	 40     8  dev           out: the device's dev_t, encoded as Mkdev does
//	 48   128  name          NUL-terminated, so at most 127 bytes
//	176   129  uuid          unused here
//	305     7  data          padding up to 312
//
// The payload of DM_TABLE_LOAD (and of the DM_TABLE_STATUS reply) is a run
// of struct dm_target_spec, each followed by a NUL-terminated string (the
// target's parameters on load, its status line in a reply), padded so that
// the next spec starts 8-byte aligned:
//
//	off  size  field
//	  0     8  sector_start
//	  8     8  length        in 512-byte sectors
//	 16     4  status        out only
//	 20     4  next          load: bytes from this spec to the next one;
//	                         reply: bytes from the FIRST spec to the next one
//	 24    16  target_type   NUL-terminated, so at most 15 bytes
//
// Integers are in the machine's byte order.
const (
	headerSize = unix.SizeofDmIoctl      // 312
	specSize   = unix.SizeofDmTargetSpec // 40

	offVersion     = 0
	offDataSize    = 12
	offDataStart   = 16
	offTargetCount = 20
	offOpenCount   = 24
	offFlags       = 28
	offEventNr     = 32
	offDev         = 40
	offName        = 48
	offUUID        = 176

	offSpecStart  = 0
	offSpecLength = 8
	offSpecStatus = 16
	offSpecNext   = 20
	offSpecType   = 24

	// maxNameLen and maxTypeLen leave room for the terminating NUL.
	maxNameLen = unix.DM_NAME_LEN - 1      // 127
	maxTypeLen = unix.DM_MAX_TYPE_NAME - 1 // 15

	// specAlign is the alignment the kernel demands of every spec.
	specAlign = 8

	// statusBufSize is the buffer a status call starts with; it is
	// doubled, up to maxStatusBufSize, while the kernel says it is full.
	statusBufSize    = 16 << 10
	maxStatusBufSize = 1 << 20
)

// ioctlVersion is the interface version we speak. The kernel accepts any
// request with its own major number and a minor number no larger than its
// own, so {4, 0, 0} works with every v4 kernel.
var ioctlVersion = [3]uint32{unix.DM_VERSION_MAJOR, 0, 0}

var ne = binary.NativeEndian

// errBufferFull means the kernel's reply did not fit the buffer we gave it.
var errBufferFull = errors.New("reply does not fit the buffer")

// checkName enforces the kernel's rules for device names (dm-ioctl.c
// check_name), so that a bad name fails here with a clear message.
func checkName(name string) error {
	switch {
	case name == "":
		return errors.New("dm: empty device name")
	case len(name) > maxNameLen:
		return fmt.Errorf("dm: device name %q is %d bytes, more than %d", name, len(name), maxNameLen)
	case strings.ContainsAny(name, "/\x00"):
		return fmt.Errorf("dm: device name %q contains '/' or NUL", name)
	case name == ".", name == "..", name == unix.DM_CONTROL_NODE:
		return fmt.Errorf("dm: device name %q is reserved", name)
	}
	return nil
}

// checkTarget rejects what the kernel would refuse to parse or would read
// differently from what the caller meant. A single-target table must
// start at sector 0 and cover at least one sector.
func checkTarget(t Target) error {
	switch {
	case t.Type == "":
		return errors.New("dm: empty target type")
	case len(t.Type) > maxTypeLen:
		return fmt.Errorf("dm: target type %q is %d bytes, more than %d", t.Type, len(t.Type), maxTypeLen)
	case strings.IndexByte(t.Type, 0) >= 0:
		return fmt.Errorf("dm: target type %q contains NUL", t.Type)
	case strings.IndexByte(t.Params, 0) >= 0:
		// A NUL would silently cut the parameters short.
		return errors.New("dm: target parameters contain NUL")
	case t.Start != 0:
		return fmt.Errorf("dm: target starts at sector %d; a single-target table must start at 0", t.Start)
	case t.Length == 0:
		return errors.New("dm: target has zero length")
	}
	return nil
}

// align8 rounds n up to a multiple of specAlign.
func align8(n int) int { return (n + specAlign - 1) &^ (specAlign - 1) }

// newRequest returns a zeroed buffer of size bytes (at least headerSize)
// with the header filled in: version, data_size = size, data_start =
// headerSize, flags and name. The payload area, if any, starts at
// headerSize and is zero.
func newRequest(name string, flags uint32, size int) ([]byte, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	size = max(size, headerSize)
	buf := make([]byte, size)
	for i, v := range ioctlVersion {
		ne.PutUint32(buf[offVersion+4*i:], v)
	}
	ne.PutUint32(buf[offDataSize:], uint32(size))
	ne.PutUint32(buf[offDataStart:], headerSize)
	ne.PutUint32(buf[offFlags:], flags)
	copy(buf[offName:offName+maxNameLen], name)
	return buf, nil
}

// tableLoadRequest builds the DM_TABLE_LOAD buffer for a one-target table:
// the header (target_count 1, the given flags), one dm_target_spec at
// data_start, then t.Params with its NUL, zero-padded to 8 bytes. next is
// the size of the spec plus its padded parameters, which is where a second
// spec would start; data_size is the size of the whole buffer.
func tableLoadRequest(name string, t Target, flags uint32) ([]byte, error) {
	if err := checkTarget(t); err != nil {
		return nil, err
	}
	next := specSize + align8(len(t.Params)+1)
	buf, err := newRequest(name, flags, headerSize+next)
	if err != nil {
		return nil, err
	}
	ne.PutUint32(buf[offTargetCount:], 1)
	spec := buf[headerSize:]
	ne.PutUint64(spec[offSpecStart:], t.Start)
	ne.PutUint64(spec[offSpecLength:], t.Length)
	ne.PutUint32(spec[offSpecNext:], uint32(next))
	copy(spec[offSpecType:offSpecType+maxTypeLen], t.Type)
	copy(spec[specSize:], t.Params) // the NUL and the padding are already zero
	return buf, nil
}

// header is the part of a reply's struct dm_ioctl that we read.
type header struct {
	version     [3]uint32
	dataSize    uint32
	dataStart   uint32
	targetCount uint32
	openCount   int32
	flags       uint32
	eventNr     uint32
	dev         uint64
}

// parseHeader reads the header of a reply buffer.
func parseHeader(buf []byte) (header, error) {
	if len(buf) < headerSize {
		return header{}, fmt.Errorf("reply is %d bytes, shorter than the %d-byte header", len(buf), headerSize)
	}
	var h header
	for i := range h.version {
		h.version[i] = ne.Uint32(buf[offVersion+4*i:])
	}
	h.dataSize = ne.Uint32(buf[offDataSize:])
	h.dataStart = ne.Uint32(buf[offDataStart:])
	h.targetCount = ne.Uint32(buf[offTargetCount:])
	h.openCount = int32(ne.Uint32(buf[offOpenCount:]))
	h.flags = ne.Uint32(buf[offFlags:])
	h.eventNr = ne.Uint32(buf[offEventNr:])
	h.dev = ne.Uint64(buf[offDev:])
	return h, nil
}

// targetStatus is one target of a DM_TABLE_STATUS reply.
type targetStatus struct {
	Start, Length uint64
	Type          string
	Status        string // the target's status line, e.g. "V" for verity
}

// parseStatus reads the targets from a DM_TABLE_STATUS reply. It checks
// every offset and length against both data_size and the buffer, so a
// malformed reply gives an error, never a panic. A reply the kernel marked
// DM_BUFFER_FULL_FLAG gives errBufferFull. A device without a live table
// gives no targets and no error.
func parseStatus(buf []byte) ([]targetStatus, error) {
	h, err := parseHeader(buf)
	if err != nil {
		return nil, err
	}
	if h.flags&unix.DM_BUFFER_FULL_FLAG != 0 {
		return nil, errBufferFull
	}
	if h.targetCount == 0 {
		return nil, nil
	}
	end := uint64(h.dataSize)
	if end > uint64(len(buf)) {
		return nil, fmt.Errorf("reply data_size %d exceeds the %d-byte buffer", end, len(buf))
	}
	first := uint64(h.dataStart)
	if first < headerSize {
		return nil, fmt.Errorf("reply data_start %d lies inside the header", first)
	}
	var out []targetStatus
	// Each pass moves off forward by more than specSize, and off stays
	// below end, so the loop ends however large target_count claims to be.
	off := first
	for i := uint32(0); i < h.targetCount; i++ {
		// The spec and at least the NUL of its string must fit.
		if off+specSize >= end {
			return nil, fmt.Errorf("target %d at offset %d runs past data_size %d", i, off, end)
		}
		spec := buf[off : off+specSize]
		rest := buf[off+specSize : end]
		n := bytes.IndexByte(rest, 0)
		if n < 0 {
			return nil, fmt.Errorf("target %d: status line has no NUL before data_size %d", i, end)
		}
		out = append(out, targetStatus{
			Start:  ne.Uint64(spec[offSpecStart:]),
			Length: ne.Uint64(spec[offSpecLength:]),
			Type:   cString(spec[offSpecType:specSize]),
			Status: string(rest[:n]),
		})
		if i+1 == h.targetCount {
			break
		}
		next := first + uint64(ne.Uint32(spec[offSpecNext:]))
		if next < off+specSize+uint64(n)+1 {
			return nil, fmt.Errorf("target %d: next spec at offset %d overlaps this one", i, next)
		}
		off = next
	}
	return out, nil
}

// cString returns b up to its first NUL, or all of b if it has none.
func cString(b []byte) string {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
}
