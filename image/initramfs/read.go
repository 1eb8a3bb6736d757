package initramfs

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"strconv"
)

// maxReadFile bounds one file's content in Read.
const maxReadFile = 1 << 30

// Read decodes a newc (070701 or 070702) archive up to its trailer and
// returns its entries with Data or Linkname filled in, for inspecting images
// and in tests. It holds every file in memory; bound r for untrusted input.
func Read(r io.Reader) ([]Entry, error) {
	var out []Entry
	var off int64
	for {
		var hdr [110]byte
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return nil, fmt.Errorf("read cpio header at %d: %w", off, unexpected(err))
		}
		off += int64(len(hdr))
		magic := string(hdr[:6])
		if magic != "070701" && magic != "070702" {
			return nil, fmt.Errorf("read cpio header at %d: bad magic %q", off-110, magic)
		}
		var f [13]uint32
		for i := range f {
			v, err := strconv.ParseUint(string(hdr[6+8*i:14+8*i]), 16, 32)
			if err != nil {
				return nil, fmt.Errorf("read cpio header at %d: field %d: %w", off-110, i, err)
			}
			f[i] = uint32(v)
		}
		mode, size, namesize := f[1], int64(f[6]), int64(f[11])
		if namesize < 1 || namesize > maxName+1 {
			return nil, fmt.Errorf("read cpio header at %d: name size %d", off-110, namesize)
		}
		name := make([]byte, namesize+int64(pad4(110+namesize)))
		if _, err := io.ReadFull(r, name); err != nil {
			return nil, fmt.Errorf("read cpio name at %d: %w", off, unexpected(err))
		}
		off += int64(len(name))
		if name[namesize-1] != 0 {
			return nil, fmt.Errorf("read cpio name at %d: not NUL terminated", off)
		}
		e := Entry{Name: string(name[:namesize-1]), UID: f[2], GID: f[3], Major: f[9], Minor: f[10]}
		if e.Name == trailer {
			return out, nil
		}
		if size > maxReadFile {
			return nil, fmt.Errorf("read cpio entry %s: %d bytes is too large", e.Name, size)
		}
		// ReadAll grows its buffer as data arrives, so a header that claims
		// a huge size cannot make Read allocate it up front.
		want := size + int64(pad4(size))
		data, err := io.ReadAll(io.LimitReader(r, want))
		if err != nil {
			return nil, fmt.Errorf("read cpio entry %s: %w", e.Name, err)
		}
		if int64(len(data)) != want {
			return nil, fmt.Errorf("read cpio entry %s: %w", e.Name, io.ErrUnexpectedEOF)
		}
		off += want
		data = data[:size:size]
		e.Mode = fs.FileMode(mode & 0o777)
		if mode&sISUID != 0 {
			e.Mode |= fs.ModeSetuid
		}
		if mode&sISGID != 0 {
			e.Mode |= fs.ModeSetgid
		}
		if mode&sISVTX != 0 {
			e.Mode |= fs.ModeSticky
		}
		switch mode & 0o170000 {
		case sIFREG:
			e.Data = data
		case sIFDIR:
			e.Mode |= fs.ModeDir
		case sIFLNK:
			e.Mode |= fs.ModeSymlink
			e.Linkname = string(data)
		case sIFCHR:
			e.Mode |= fs.ModeDevice | fs.ModeCharDevice
		case sIFBLK:
			e.Mode |= fs.ModeDevice
		default:
			return nil, fmt.Errorf("read cpio entry %s: unsupported mode %o", e.Name, mode)
		}
		out = append(out, e)
	}
}

func unexpected(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}
