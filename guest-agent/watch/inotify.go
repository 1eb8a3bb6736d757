//go:build linux

package watch

import (
	"bytes"
	"encoding/binary"
	"errors"
	"strings"

	"golang.org/x/sys/unix"
)

// dirMask is what every watched directory reports. IN_EXCL_UNLINK keeps
// writes to files already unlinked (but still open) quiet.
const dirMask = unix.IN_CREATE | unix.IN_MODIFY | unix.IN_DELETE | unix.IN_MOVED_FROM | unix.IN_MOVED_TO |
	unix.IN_DELETE_SELF | unix.IN_MOVE_SELF | unix.IN_ONLYDIR | unix.IN_EXCL_UNLINK

// readBuffer holds many records; the kernel needs room for at least one
// record with the longest name (16 + NAME_MAX + 1 bytes).
const readBuffer = 64 << 10

// errTruncated is a record that runs past the bytes read. The kernel only
// returns whole records, so this means the stream cannot be trusted.
var errTruncated = errors.New("inotify: truncated record")

// rawEvent is one inotify record.
type rawEvent struct {
	wd     int32
	mask   uint32
	cookie uint32
	// name is the entry's name within the watched directory, empty for
	// events about the directory itself.
	name string
}

// parseEvents decodes the inotify records in b, in order, calling fn for
// each. It stops with errTruncated at a record that does not fit in b;
// records before it have been passed to fn.
func parseEvents(b []byte, fn func(rawEvent)) error {
	for len(b) > 0 {
		if len(b) < unix.SizeofInotifyEvent {
			return errTruncated
		}
		n := binary.NativeEndian.Uint32(b[12:16])
		if uint64(n) > uint64(len(b)-unix.SizeofInotifyEvent) {
			return errTruncated
		}
		name := b[unix.SizeofInotifyEvent : unix.SizeofInotifyEvent+int(n)]
		// The name is padded with NULs to an alignment boundary.
		if i := bytes.IndexByte(name, 0); i >= 0 {
			name = name[:i]
		}
		fn(rawEvent{
			wd:     int32(binary.NativeEndian.Uint32(b[0:4])),
			mask:   binary.NativeEndian.Uint32(b[4:8]),
			cookie: binary.NativeEndian.Uint32(b[8:12]),
			name:   string(name),
		})
		b = b[unix.SizeofInotifyEvent+int(n):]
	}
	return nil
}

// validName reports whether name can be one entry of a directory.
func validName(name string) bool {
	return name != "" && name != "." && name != ".." && len(name) <= unix.NAME_MAX && !strings.ContainsAny(name, "/\x00")
}
