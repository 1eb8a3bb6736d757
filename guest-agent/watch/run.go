//go:build linux

package watch

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

const (
	// pairWait is how long a MOVED_FROM waits for its MOVED_TO. The kernel
	// queues both halves within the one rename call, so this only covers
	// a read that fell between them; but a guest whose vCPU the host
	// preempts (TCG on a busy host) can stall there for tens of
	// milliseconds, and 10 ms once split a rename in make test. A move out
	// of the tree is reported this much later.
	pairWait = 200 * time.Millisecond
	// scannedTTL is how long a create reported by a scan waits to be
	// matched (and swallowed) by the kernel's own event for it.
	scannedTTL = 2 * time.Second
	// maxScanned bounds that memory.
	maxScanned = 1 << 16
)

// Run watches dir until ctx ends (it returns ctx's error) or dir itself is
// removed or moved away (it returns nil), calling send with each batch.
// The first batch comes once the watch is in place; it has no events. An error
// from send ends Run with that error. dir must be an absolute, clean path;
// a symlink there is followed, symlinks below it are not.
func Run(ctx context.Context, dir string, opts Options, send func(Batch) error) error {
	opts = opts.withDefaults()
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		return os.NewSyscallError("inotify_init1", err)
	}
	// Non-blocking, so the runtime's poller serves reads and deadlines.
	f := os.NewFile(uintptr(fd), "inotify")
	defer f.Close()

	wd, err := unix.InotifyAddWatch(fd, dir, dirMask)
	if err != nil {
		return &fs.PathError{Op: "watch", Path: dir, Err: err}
	}
	w := &watcher{
		ctx: ctx, fd: fd, opts: opts, root: dir, rootWd: int32(wd),
		paths: map[int32]string{int32(wd): dir}, wds: map[string]int32{dir: int32(wd)},
		scanned: map[string]time.Time{},
	}
	w.out = newBatcher(opts, send, time.Now())
	if opts.Recursive {
		if err := w.scan(dir, false); err != nil {
			return err
		}
	}
	// The watch is in place: say so, with what the scan left unwatched.
	w.out.flush(true)
	if w.out.err != nil {
		return w.out.err
	}
	// Cancellation wakes the read below. Run sets its own deadlines too,
	// but only before it checks ctx, so this one is never lost.
	stop := context.AfterFunc(ctx, func() { f.SetReadDeadline(time.Unix(1, 0)) })
	defer stop()

	buf := make([]byte, readBuffer)
	for {
		if err := f.SetReadDeadline(w.deadline()); err != nil {
			return fmt.Errorf("inotify: %w", err)
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		n, err := f.Read(buf)
		now := time.Now()
		if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return fmt.Errorf("read inotify: %w", err)
		}
		if n > 0 {
			if err := parseEvents(buf[:n], func(ev rawEvent) { w.handle(ev, now) }); err != nil {
				return err
			}
		}
		if w.pending != nil && !now.Before(w.pending.at.Add(pairWait)) {
			w.movedOut(now)
		}
		if w.done {
			w.out.flush(false)
			return w.out.err
		}
		if w.out.due(now) {
			w.out.flush(false)
		}
		if w.out.err != nil {
			return w.out.err
		}
		w.expireScanned(now)
	}
}

// move is a MOVED_FROM waiting for its MOVED_TO.
type move struct {
	cookie uint32
	path   string
	isDir  bool
	at     time.Time
}

type watcher struct {
	ctx    context.Context
	fd     int
	opts   Options
	root   string
	rootWd int32
	out    *batcher

	paths map[int32]string // watch descriptor to directory
	wds   map[string]int32 // directory to watch descriptor
	// scanned holds creates that a scan reported, until the kernel's own
	// event for the same path arrives (or they expire).
	scanned map[string]time.Time
	expired time.Time // when scanned was last swept
	pending *move
	// done: the watched directory is gone.
	done bool
}

// deadline is when the loop must wake without events; zero for never.
func (w *watcher) deadline() time.Time {
	t := w.out.flushAt
	if w.pending != nil {
		if p := w.pending.at.Add(pairWait); t.IsZero() || p.Before(t) {
			t = p
		}
	}
	return t
}

func (w *watcher) emit(op Op, path, old string, isDir bool, now time.Time) {
	w.out.add(Event{Op: op, Path: path, OldPath: old, IsDir: isDir, Time: now})
}

// handle acts on one inotify record.
func (w *watcher) handle(ev rawEvent, now time.Time) {
	if w.done {
		return
	}
	if ev.mask&unix.IN_Q_OVERFLOW != 0 {
		w.movedOut(now)
		w.out.drop(1, now)
		return
	}
	dir, ok := w.paths[ev.wd]
	if !ok {
		return // a watch already let go
	}
	if ev.mask&(unix.IN_IGNORED|unix.IN_DELETE_SELF|unix.IN_MOVE_SELF|unix.IN_UNMOUNT) != 0 {
		if ev.wd == w.rootWd {
			w.movedOut(now)
			w.emit(Delete, w.root, "", true, now)
			w.done = true
		} else if ev.mask&unix.IN_IGNORED != 0 {
			w.forget(ev.wd)
		}
		// A subdirectory's own removal or move is reported by its parent.
		return
	}
	if !validName(ev.name) {
		return
	}
	p := join(dir, ev.name)
	isDir := ev.mask&unix.IN_ISDIR != 0
	if w.pending != nil && (ev.mask&unix.IN_MOVED_TO == 0 || ev.cookie != w.pending.cookie) {
		w.movedOut(now)
	}
	switch {
	case ev.mask&unix.IN_CREATE != 0:
		if _, ok := w.scanned[p]; ok {
			delete(w.scanned, p) // reported by the scan that found it
			return
		}
		w.emit(Create, p, "", isDir, now)
		if isDir && w.opts.Recursive && w.watchDir(p, now) {
			w.scan(p, true)
		}
	case ev.mask&unix.IN_MODIFY != 0:
		w.emit(Modify, p, "", isDir, now)
	case ev.mask&unix.IN_DELETE != 0:
		delete(w.scanned, p)
		w.emit(Delete, p, "", isDir, now)
	case ev.mask&unix.IN_MOVED_FROM != 0:
		delete(w.scanned, p)
		w.pending = &move{cookie: ev.cookie, path: p, isDir: isDir, at: now}
	case ev.mask&unix.IN_MOVED_TO != 0:
		if m := w.pending; m != nil {
			w.pending = nil
			w.emit(Rename, p, m.path, isDir, now)
			if isDir {
				w.renameTree(m.path, p)
			}
			return
		}
		w.emit(Create, p, "", isDir, now)
		if isDir && w.opts.Recursive && w.watchDir(p, now) {
			w.scan(p, false)
		}
	}
}

// movedOut reports a MOVED_FROM without its MOVED_TO, which left the
// watched tree, as a delete, and lets go of the watches below it.
func (w *watcher) movedOut(now time.Time) {
	m := w.pending
	if m == nil {
		return
	}
	w.pending = nil
	w.emit(Delete, m.path, "", m.isDir, now)
	if !m.isDir {
		return
	}
	for wd, p := range w.paths {
		if wd != w.rootWd && within(m.path, p) {
			unix.InotifyRmWatch(w.fd, uint32(wd))
			w.forget(wd)
		}
	}
}

// renameTree moves the watches at and below from to the same places below
// to.
func (w *watcher) renameTree(from, to string) {
	for wd, p := range w.paths {
		if wd == w.rootWd || !within(from, p) {
			continue
		}
		np := to + p[len(from):]
		if w.wds[p] == wd {
			delete(w.wds, p)
		}
		w.paths[wd] = np
		w.wds[np] = wd
	}
}

func (w *watcher) forget(wd int32) {
	p, ok := w.paths[wd]
	if !ok {
		return
	}
	delete(w.paths, wd)
	if w.wds[p] == wd {
		delete(w.wds, p)
	}
}

// watchDir adds a watch on the subdirectory p and reports whether it is
// new to this watch. A directory over the cap is counted as unwatched.
func (w *watcher) watchDir(p string, now time.Time) bool {
	if len(w.paths) >= w.opts.MaxDirs {
		w.out.unwatched(now)
		return false
	}
	wd, err := unix.InotifyAddWatch(w.fd, p, dirMask|unix.IN_DONT_FOLLOW)
	switch {
	case err == nil:
	case errors.Is(err, unix.ENOENT), errors.Is(err, unix.ENOTDIR):
		return false // gone, or replaced, since it was seen
	default:
		// ENOSPC: the kernel's max_user_watches; EACCES; ENAMETOOLONG.
		w.out.unwatched(now)
		return false
	}
	if _, ok := w.paths[int32(wd)]; ok {
		// The same directory again (a bind mount): do not loop.
		return false
	}
	w.paths[int32(wd)] = p
	w.wds[p] = int32(wd)
	return true
}

// scan lists dir, which is watched, and watches its subdirectories, all
// the way down. With report, everything it finds is reported as a create:
// it was made before its directory's watch could see it.
func (w *watcher) scan(dir string, report bool) error {
	stack := []string{dir}
	for len(stack) > 0 {
		if err := w.ctx.Err(); err != nil {
			return err
		}
		d := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		f, err := os.Open(d)
		if err != nil {
			continue // gone since, or not ours to read
		}
		for {
			ents, err := f.ReadDir(256)
			now := time.Now()
			for _, e := range ents {
				p := join(d, e.Name())
				isDir := e.Type().IsDir()
				if report {
					w.emit(Create, p, "", isDir, now)
					if len(w.scanned) < maxScanned {
						w.scanned[p] = now
					}
				}
				if isDir && w.opts.Recursive && w.watchDir(p, now) {
					stack = append(stack, p)
				}
			}
			if err != nil {
				break
			}
		}
		f.Close()
	}
	return nil
}

func (w *watcher) expireScanned(now time.Time) {
	if len(w.scanned) == 0 || now.Sub(w.expired) < scannedTTL {
		return
	}
	w.expired = now
	for p, t := range w.scanned {
		if now.Sub(t) > scannedTTL {
			delete(w.scanned, p)
		}
	}
}

func join(dir, name string) string {
	if dir == "/" {
		return "/" + name
	}
	return dir + "/" + name
}

// within reports whether p is dir or below it.
func within(dir, p string) bool {
	return p == dir || (strings.HasPrefix(p, dir) && (dir == "/" || p[len(dir)] == '/'))
}
