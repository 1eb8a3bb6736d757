//go:build linux

package activity

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// markMask is what the watch asks the kernel for. FAN_ONDIR adds the
// directories' own events (mkdir, rmdir, a directory's move); the opens of
// directories it brings are left out (see opsOf).
const markMask = unix.FAN_OPEN | unix.FAN_MODIFY | unix.FAN_CREATE | unix.FAN_DELETE |
	unix.FAN_MOVED_FROM | unix.FAN_MOVED_TO | unix.FAN_ONDIR

// Bounds of what the kernel may report, checked on every event.
const (
	maxHandleBytes = 128 // MAX_HANDLE_SZ
	maxNameBytes   = 255 // NAME_MAX
	metadataBytes  = 24  // struct fanotify_event_metadata
	infoHeaderSize = 4   // struct fanotify_event_info_header
	fsidBytes      = 8
)

// fileID is a file handle the kernel reported: open_by_handle_at's input.
type fileID struct {
	typ   int32
	bytes []byte
}

// key is the handle as a map key.
func (h fileID) key() string { return strconv.Itoa(int(h.typ)) + ":" + string(h.bytes) }

// rawEvent is one event as read from the fanotify group, before its path
// is resolved or its process attributed.
type rawEvent struct {
	mask uint64
	// fd is FAN_NOFD in FID mode; anything else is the reader's to close.
	fd  int32
	pid int32
	// dir is the directory of the object (FAN_REPORT_DIR_FID), name the
	// object's name in it ("." for the directory itself).
	dir     fileID
	name    string
	hasDir  bool
	hasName bool
	// child is the object's own handle (FAN_REPORT_TARGET_FID), when
	// reported.
	child    fileID
	hasChild bool
}

// errBadEvent is what parseEvents returns when the kernel's buffer does not
// parse; the rest of that buffer is skipped.
var errBadEvent = errors.New("activity: malformed fanotify event")

// parseEvents calls fn for each event in buf, the bytes of one read from a
// fanotify group reporting FAN_REPORT_DFID_NAME (and maybe
// FAN_REPORT_TARGET_FID). The rawEvents' handles alias buf. Every length is
// checked against the bounds of the buffer and of the kernel's types; a
// malformed event ends the parse with errBadEvent.
func parseEvents(buf []byte, fn func(rawEvent)) error {
	le := binary.NativeEndian
	for len(buf) > 0 {
		if len(buf) < metadataBytes {
			return errBadEvent
		}
		evLen := le.Uint32(buf[0:])
		vers := buf[4]
		metaLen := le.Uint16(buf[6:])
		if vers != unix.FANOTIFY_METADATA_VERSION || evLen < metadataBytes || uint64(evLen) > uint64(len(buf)) ||
			metaLen < metadataBytes || uint32(metaLen) > evLen {
			return errBadEvent
		}
		ev := rawEvent{mask: le.Uint64(buf[8:]), fd: int32(le.Uint32(buf[16:])), pid: int32(le.Uint32(buf[20:]))}
		info := buf[metaLen:evLen]
		for len(info) > 0 {
			if len(info) < infoHeaderSize {
				return errBadEvent
			}
			typ := info[0]
			n := int(le.Uint16(info[2:]))
			if n < infoHeaderSize || n > len(info) {
				return errBadEvent
			}
			rec := info[infoHeaderSize:n]
			info = info[n:]
			switch typ {
			case unix.FAN_EVENT_INFO_TYPE_DFID_NAME, unix.FAN_EVENT_INFO_TYPE_DFID, unix.FAN_EVENT_INFO_TYPE_FID:
			default:
				continue // a kind we did not ask for: skip it
			}
			h, rest, ok := parseFileID(rec)
			if !ok {
				return errBadEvent
			}
			switch typ {
			case unix.FAN_EVENT_INFO_TYPE_FID:
				ev.child, ev.hasChild = h, true
			case unix.FAN_EVENT_INFO_TYPE_DFID:
				ev.dir, ev.hasDir = h, true
			case unix.FAN_EVENT_INFO_TYPE_DFID_NAME:
				name, ok := parseName(rest)
				if !ok {
					return errBadEvent
				}
				ev.dir, ev.hasDir, ev.name, ev.hasName = h, true, name, true
			}
		}
		fn(ev)
		buf = buf[evLen:]
	}
	return nil
}

// parseFileID parses `fsid, struct file_handle` and returns what follows.
func parseFileID(rec []byte) (fileID, []byte, bool) {
	le := binary.NativeEndian
	if len(rec) < fsidBytes+8 {
		return fileID{}, nil, false
	}
	rec = rec[fsidBytes:]
	n := le.Uint32(rec[0:])
	typ := int32(le.Uint32(rec[4:]))
	rec = rec[8:]
	if n == 0 || n > maxHandleBytes || uint64(n) > uint64(len(rec)) {
		return fileID{}, nil, false
	}
	return fileID{typ: typ, bytes: rec[:n]}, rec[n:], true
}

// parseName parses the NUL-terminated name after a directory's handle
// (padding may follow the NUL). A name is 1 to NAME_MAX bytes with no
// slash, and never "..".
func parseName(b []byte) (string, bool) {
	end := -1
	for i, c := range b {
		if c == 0 {
			end = i
			break
		}
		if c == '/' {
			return "", false
		}
	}
	if end <= 0 || end > maxNameBytes {
		return "", false
	}
	name := string(b[:end])
	if name == ".." {
		return "", false
	}
	return name, true
}

// opsOf returns the operations an event's mask reports, in the order they
// must have happened when the kernel merged several into one event. A
// directory's open (a listing) is not reported.
func opsOf(mask uint64) []Op {
	var ops []Op
	dir := mask&unix.FAN_ONDIR != 0
	if mask&unix.FAN_CREATE != 0 {
		ops = append(ops, Create)
	}
	if mask&unix.FAN_MOVED_TO != 0 {
		ops = append(ops, MoveTo)
	}
	if mask&unix.FAN_OPEN != 0 && !dir {
		ops = append(ops, Open)
	}
	if mask&unix.FAN_MODIFY != 0 && !dir {
		ops = append(ops, Modify)
	}
	if mask&unix.FAN_MOVED_FROM != 0 {
		ops = append(ops, MoveFrom)
	}
	if mask&unix.FAN_DELETE != 0 {
		ops = append(ops, Delete)
	}
	return ops
}

// group is a fanotify group watching the file system that holds root.
type group struct {
	// f is the group, nonblocking and in the Go runtime's poller, so the
	// reader waits for it without holding a thread in a system call.
	f     *os.File
	mount int // root, open: the file system's handles resolve against it
	root  string
	dirs  *dirCache
}

// openGroup sets up the watch: FAN_REPORT_DFID_NAME, with the object's
// own handle too (FAN_REPORT_FID | FAN_REPORT_TARGET_FID) where the kernel
// has it (5.17), and a mark on root's whole file system.
func openGroup(root string, cacheSize int) (*group, error) {
	const base = unix.FAN_CLASS_NOTIF | unix.FAN_CLOEXEC | unix.FAN_NONBLOCK | unix.FAN_REPORT_DFID_NAME
	const eventFlags = unix.O_RDONLY | unix.O_LARGEFILE | unix.O_CLOEXEC
	fd, err := unix.FanotifyInit(base|unix.FAN_REPORT_FID|unix.FAN_REPORT_TARGET_FID, eventFlags)
	if errors.Is(err, unix.EINVAL) {
		fd, err = unix.FanotifyInit(base, eventFlags)
	}
	if err != nil {
		return nil, fmt.Errorf("activity: fanotify_init: %w", err)
	}
	if err := unix.FanotifyMark(fd, unix.FAN_MARK_ADD|unix.FAN_MARK_FILESYSTEM, markMask, unix.AT_FDCWD, root); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("activity: fanotify_mark %s: %w", root, err)
	}
	mount, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("activity: open %s: %w", root, err)
	}
	// FAN_NONBLOCK: NewFile puts the group in the poller.
	f := os.NewFile(uintptr(fd), "fanotify")
	return &group{f: f, mount: mount, root: root, dirs: newDirCache(cacheSize)}, nil
}

func (g *group) close() error {
	return errors.Join(g.closeGroup(), unix.Close(g.mount))
}

// closeGroup closes the group alone: a read waiting for it ends at once,
// with an error, and the descriptor is closed once no read is under way.
func (g *group) closeGroup() error {
	if err := g.f.Close(); err != nil && !errors.Is(err, os.ErrClosed) {
		return err
	}
	return nil
}

// dirPath returns the path a directory handle leads to now. A directory
// that is gone (removed, or its handle stale) is looked up in the cache of
// paths seen before.
func (g *group) dirPath(h fileID) (string, bool) {
	fd, err := unix.OpenByHandleAt(g.mount, unix.NewFileHandle(h.typ, h.bytes), unix.O_PATH|unix.O_CLOEXEC)
	if err == nil {
		p, ok := livePath(fd)
		unix.Close(fd)
		if ok {
			g.dirs.put(h.key(), p)
			return p, true
		}
	}
	return g.dirs.get(h.key())
}

// livePath returns the path of an open file, unless it has been removed.
// The link count is checked after the path is read: a file removed before
// the path was read (which then ends in " (deleted)") has none left.
func livePath(fd int) (string, bool) {
	buf := make([]byte, MaxPathBytes+1)
	n, err := unix.Readlink("/proc/self/fd/"+strconv.Itoa(fd), buf)
	if err != nil || n > MaxPathBytes || n == 0 || buf[0] != '/' {
		return "", false
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Nlink == 0 {
		return "", false
	}
	return string(buf[:n]), true
}

// dirCache remembers the paths of directory handles, so that events in a
// directory removed before they were read still find their path. It holds
// at most size entries; when full, it starts again empty.
type dirCache struct {
	size  int
	paths map[string]string
}

func newDirCache(size int) *dirCache { return &dirCache{size: size, paths: make(map[string]string)} }

func (c *dirCache) put(k, p string) {
	if _, ok := c.paths[k]; !ok && len(c.paths) >= c.size {
		clear(c.paths)
	}
	c.paths[k] = p
}

func (c *dirCache) get(k string) (string, bool) {
	p, ok := c.paths[k]
	return p, ok
}
