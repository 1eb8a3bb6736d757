package vm

import (
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// qcow2 header fields carreld reads (QEMU's docs/interop/qcow2.txt): the
// magic, the backing file name's offset and size, and the virtual size.
const (
	qcow2Magic       = 0x514649fb // "QFI\xfb"
	qcow2HeaderBytes = 32
	maxBackingName   = 1023 // QEMU's own limit
	// maxChain bounds a disk's chain: each snapshot adds a layer under
	// the VM's disks, and a chain that names itself must end.
	maxChain            = 1024
	qcow2OffBackingOff  = 8
	qcow2OffBackingSize = 16
	qcow2OffSize        = 24
)

// qcow2Info is what carreld reads of a qcow2 file's header.
type qcow2Info struct {
	Backing      string // "" for none
	VirtualBytes uint64
}

// readQCOW2 reads the header of the qcow2 file at path. It trusts nothing
// in it: sizes are bounded and the name must lie inside the file.
func readQCOW2(path string) (qcow2Info, error) {
	f, err := os.Open(path)
	if err != nil {
		return qcow2Info{}, err
	}
	defer f.Close()
	var h [qcow2HeaderBytes]byte
	if _, err := io.ReadFull(f, h[:]); err != nil {
		return qcow2Info{}, fmt.Errorf("%s: qcow2 header: %w", path, err)
	}
	if binary.BigEndian.Uint32(h[0:]) != qcow2Magic {
		return qcow2Info{}, fmt.Errorf("%s: not a qcow2 file", path)
	}
	info := qcow2Info{VirtualBytes: binary.BigEndian.Uint64(h[qcow2OffSize:])}
	off := binary.BigEndian.Uint64(h[qcow2OffBackingOff:])
	n := binary.BigEndian.Uint32(h[qcow2OffBackingSize:])
	if off == 0 || n == 0 {
		return info, nil
	}
	if n > maxBackingName || off > 1<<20 {
		return qcow2Info{}, fmt.Errorf("%s: qcow2 backing file name of %d bytes at %d", path, n, off)
	}
	name := make([]byte, n)
	if _, err := f.ReadAt(name, int64(off)); err != nil {
		return qcow2Info{}, fmt.Errorf("%s: qcow2 backing file name: %w", path, err)
	}
	info.Backing = string(name)
	return info, nil
}

// chain returns path and every file under it, top first, following the
// backing names in qcow2 headers down to a file that is not qcow2 (the
// raw template) or names no backing. A relative name is relative to its
// file's directory, as QEMU reads it.
func chain(path string) ([]string, error) {
	out := []string{path}
	for len(out) <= maxChain {
		info, err := readQCOW2(path)
		if err != nil {
			return out, err
		}
		if info.Backing == "" {
			return out, nil
		}
		next := info.Backing
		if !filepath.IsAbs(next) {
			next = filepath.Join(filepath.Dir(path), next)
		}
		out = append(out, next)
		if !isQCOW2(next) {
			return out, nil
		}
		path = next
	}
	return out, fmt.Errorf("%s: a backing chain of over %d files", out[0], maxChain)
}

// isQCOW2 reports whether path starts with the qcow2 magic.
func isQCOW2(path string) bool {
	f, err := os.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	var m [4]byte
	if _, err := io.ReadFull(f, m[:]); err != nil {
		return false
	}
	return binary.BigEndian.Uint32(m[:]) == qcow2Magic
}
