//go:build linux

package watch

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// watching is one Run under test.
type watching struct {
	t       *testing.T
	dir     string
	batches chan Batch
	cancel  context.CancelFunc
	done    chan error
}

// start runs a watch of a new temporary directory (or of dir, if set) and
// returns once it is in place, with the count of directories it left
// unwatched.
func start(t *testing.T, dir string, opts Options) (*watching, uint64) {
	t.Helper()
	if dir == "" {
		dir = t.TempDir()
	}
	ctx, cancel := context.WithCancel(context.Background())
	w := &watching{t: t, dir: dir, batches: make(chan Batch, 1000), cancel: cancel, done: make(chan error, 1)}
	go func() {
		w.done <- Run(ctx, dir, opts, func(b Batch) error {
			w.batches <- b
			return nil
		})
	}()
	t.Cleanup(func() {
		cancel()
		<-w.done
	})
	select {
	case b := <-w.batches:
		if len(b.Events) != 0 || b.Dropped != 0 {
			t.Fatalf("first batch %+v, want no events", b)
		}
		return w, b.UnwatchedDirs
	case err := <-w.done:
		t.Fatalf("run: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the watch never said it was in place")
	}
	return nil, 0
}

func (w *watching) path(rel string) string { return filepath.Join(w.dir, rel) }

// line is how tests compare events: "OP rel" or "RENAME old -> new", with
// "/" after a directory.
func (w *watching) line(e Event) string {
	rel := func(p string) string {
		r, _ := filepath.Rel(w.dir, p)
		if e.IsDir {
			r += "/"
		}
		return r
	}
	if e.Op == Rename {
		return fmt.Sprintf("%s %s -> %s", e.Op, rel(e.OldPath), rel(e.Path))
	}
	return fmt.Sprintf("%s %s", e.Op, rel(e.Path))
}

// expect reads events until it has seen each of want, in order (other
// events may come between), and returns everything read.
func (w *watching) expect(want ...string) []string {
	w.t.Helper()
	var got []string
	deadline := time.After(10 * time.Second)
	for len(want) > 0 {
		select {
		case b := <-w.batches:
			for _, e := range b.Events {
				l := w.line(e)
				got = append(got, l)
				if len(want) > 0 && l == want[0] {
					want = want[1:]
				}
			}
		case <-deadline:
			w.t.Fatalf("still waiting for %q; got %q", want, got)
		}
	}
	return got
}

// drain returns what arrives within d.
func (w *watching) drain(d time.Duration) (events []Event, dropped, unwatched uint64) {
	end := time.After(d)
	for {
		select {
		case b := <-w.batches:
			events = append(events, b.Events...)
			dropped += b.Dropped
			unwatched += b.UnwatchedDirs
		case <-end:
			return
		}
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func TestCreateModifyRenameDelete(t *testing.T) {
	w, _ := start(t, "", Options{Recursive: true})
	must(t, os.WriteFile(w.path("a.txt"), []byte("hello"), 0o644))
	w.expect("CREATE a.txt", "MODIFY a.txt")
	f, err := os.OpenFile(w.path("a.txt"), os.O_APPEND|os.O_WRONLY, 0)
	must(t, err)
	for range 100 {
		f.WriteString("more")
	}
	f.Close()
	got := w.expect("MODIFY a.txt")
	must(t, os.Rename(w.path("a.txt"), w.path("b.txt")))
	got = append(got, w.expect("RENAME a.txt -> b.txt")...)
	must(t, os.Remove(w.path("b.txt")))
	got = append(got, w.expect("DELETE b.txt")...)
	// A hundred writes within a batch are one event.
	if n := strings.Count(strings.Join(got, "\n"), "MODIFY"); n > 3 {
		t.Errorf("%d MODIFY events for writes in one burst; want them merged: %q", n, got)
	}
}

func TestNewSubdirectoriesAreFollowed(t *testing.T) {
	w, _ := start(t, "", Options{Recursive: true})
	// Made at once: the watch on d is added after d/e and d/e/f exist, so
	// they come from the scan of d.
	must(t, os.MkdirAll(w.path("d/e"), 0o755))
	must(t, os.WriteFile(w.path("d/e/f"), nil, 0o644))
	w.expect("CREATE d/", "CREATE d/e/", "CREATE d/e/f")
	// Now watched: later changes deep down are seen too.
	must(t, os.WriteFile(w.path("d/e/g"), []byte("x"), 0o644))
	must(t, os.Remove(w.path("d/e/f")))
	w.expect("CREATE d/e/g", "MODIFY d/e/g", "DELETE d/e/f")
	must(t, os.RemoveAll(w.path("d")))
	w.expect("DELETE d/e/g", "DELETE d/e/", "DELETE d/")
}

func TestScanAndEventAreNotBothReported(t *testing.T) {
	w, _ := start(t, "", Options{Recursive: true})
	for i := range 20 {
		d := w.path(fmt.Sprintf("d%d", i))
		must(t, os.Mkdir(d, 0o755))
		must(t, os.WriteFile(filepath.Join(d, "f"), nil, 0o644))
	}
	events, _, _ := w.drain(500 * time.Millisecond)
	seen := map[string]int{}
	for _, e := range events {
		seen[w.line(e)]++
	}
	for i := range 20 {
		for _, l := range []string{fmt.Sprintf("CREATE d%d/", i), fmt.Sprintf("CREATE d%d/f", i)} {
			if seen[l] != 1 {
				t.Errorf("%q reported %d times", l, seen[l])
			}
		}
	}
}

func TestRenamedDirectoryKeepsBeingWatched(t *testing.T) {
	w, _ := start(t, "", Options{Recursive: true})
	must(t, os.MkdirAll(w.path("old/sub"), 0o755))
	w.expect("CREATE old/", "CREATE old/sub/")
	must(t, os.Rename(w.path("old"), w.path("new")))
	w.expect("RENAME old/ -> new/")
	must(t, os.WriteFile(w.path("new/sub/x"), nil, 0o644))
	w.expect("CREATE new/sub/x")
}

func TestMovesInAndOut(t *testing.T) {
	outside := t.TempDir()
	w, _ := start(t, "", Options{Recursive: true})
	must(t, os.WriteFile(filepath.Join(outside, "in"), nil, 0o644))
	must(t, os.MkdirAll(filepath.Join(outside, "tree/deep"), 0o755))
	must(t, os.Rename(filepath.Join(outside, "in"), w.path("in")))
	must(t, os.Rename(filepath.Join(outside, "tree"), w.path("tree")))
	w.expect("CREATE in", "CREATE tree/")
	// A tree moved in is watched, though its contents were not reported.
	must(t, os.WriteFile(w.path("tree/deep/x"), nil, 0o644))
	w.expect("CREATE tree/deep/x")

	must(t, os.Rename(w.path("tree"), filepath.Join(outside, "gone")))
	w.expect("DELETE tree/")
	// Let go: changes in the tree now outside are not reported.
	must(t, os.WriteFile(filepath.Join(outside, "gone/deep/y"), nil, 0o644))
	must(t, os.WriteFile(w.path("marker"), nil, 0o644))
	for _, l := range w.expect("CREATE marker") {
		if strings.Contains(l, "y") {
			t.Errorf("reported a change outside the watch: %s", l)
		}
	}
}

func TestRootRemovedEndsTheWatch(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "root")
	must(t, os.Mkdir(dir, 0o755))
	w, _ := start(t, dir, Options{Recursive: true})
	must(t, os.Mkdir(w.path("sub"), 0o755))
	w.expect("CREATE sub/")
	must(t, os.RemoveAll(dir))
	w.expect("DELETE sub/", "DELETE ./")
	select {
	case err := <-w.done:
		w.done <- err // for the cleanup
		if err != nil {
			t.Errorf("run ended with %v, want nil", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("run did not end when its directory was removed")
	}
}

func TestNotRecursive(t *testing.T) {
	w, _ := start(t, "", Options{})
	must(t, os.MkdirAll(w.path("sub/deeper"), 0o755))
	must(t, os.WriteFile(w.path("sub/x"), nil, 0o644))
	must(t, os.WriteFile(w.path("top"), nil, 0o644))
	got := w.expect("CREATE sub/", "CREATE top")
	for _, l := range got {
		if strings.Contains(l, "sub/") && l != "CREATE sub/" {
			t.Errorf("not recursive, yet reported %s", l)
		}
	}
}

func TestRateLimitCountsDropped(t *testing.T) {
	w, _ := start(t, "", Options{Recursive: true, Rate: 10})
	const n = 200
	for i := range n {
		f, err := os.Create(w.path(fmt.Sprint(i)))
		must(t, err)
		f.Close()
	}
	events, dropped, _ := w.drain(500 * time.Millisecond)
	// A second's worth at once, then 10 a second.
	if len(events) > 20 || uint64(len(events))+dropped != n {
		t.Errorf("%d events sent and %d dropped of %d, want at most 20 sent and the rest dropped", len(events), dropped, n)
	}
}

func TestBatchesAreBounded(t *testing.T) {
	w, _ := start(t, "", Options{Recursive: true, MaxBatch: 7, Rate: 10000})
	for i := range 50 {
		f, err := os.Create(w.path(fmt.Sprint(i)))
		must(t, err)
		f.Close()
	}
	total := 0
	deadline := time.After(10 * time.Second)
	for total < 50 {
		select {
		case b := <-w.batches:
			if len(b.Events) > 7 {
				t.Fatalf("batch of %d events, cap 7", len(b.Events))
			}
			total += len(b.Events)
		case <-deadline:
			t.Fatalf("saw %d of 50 events", total)
		}
	}
}

func TestMaxDirsCountsUnwatched(t *testing.T) {
	dir := t.TempDir()
	for i := range 5 {
		must(t, os.MkdirAll(filepath.Join(dir, fmt.Sprint(i), "sub"), 0o755))
	}
	// The root and two more are watched. Left out: the other three at
	// the top, the two below those watched, and the new one (below those
	// left out, nothing is seen).
	w, first := start(t, dir, Options{Recursive: true, MaxDirs: 3})
	if first != 5 {
		t.Errorf("the first batch counts %d directories unwatched, want 5", first)
	}
	must(t, os.Mkdir(w.path("new"), 0o755))
	events, _, unwatched := w.drain(500 * time.Millisecond)
	if unwatched != 1 {
		t.Errorf("%d more directories reported unwatched, want 1 (%v)", unwatched, events)
	}
	if len(events) != 1 || w.line(events[0]) != "CREATE new/" {
		t.Errorf("events %v, want the new directory's create only", events)
	}
}

func TestCancelEndsRun(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	ready := make(chan struct{}, 1)
	go func() {
		done <- Run(ctx, t.TempDir(), Options{Recursive: true}, func(Batch) error {
			ready <- struct{}{}
			return nil
		})
	}()
	<-ready
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("run = %v, want context.Canceled", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("run did not end when cancelled")
	}
}

func TestSendErrorEndsRun(t *testing.T) {
	dir := t.TempDir()
	boom := errors.New("client gone")
	done := make(chan error, 1)
	ready := make(chan struct{})
	var n int
	go func() {
		done <- Run(context.Background(), dir, Options{}, func(Batch) error {
			if n++; n > 1 {
				return boom
			}
			close(ready) // the first batch: the watch is in place
			return nil
		})
	}()
	<-ready
	must(t, os.WriteFile(filepath.Join(dir, "x"), nil, 0o644))
	select {
	case err := <-done:
		if !errors.Is(err, boom) {
			t.Errorf("run = %v, want %v", err, boom)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("run did not end when send failed")
	}
}

func TestRunErrors(t *testing.T) {
	dir := t.TempDir()
	must(t, os.WriteFile(filepath.Join(dir, "file"), nil, 0o644))
	for p, want := range map[string]error{
		filepath.Join(dir, "missing"): unix.ENOENT,
		filepath.Join(dir, "file"):    unix.ENOTDIR,
	} {
		err := Run(context.Background(), p, Options{}, func(Batch) error { return nil })
		if !errors.Is(err, want) {
			t.Errorf("watch %s: %v, want %v", p, err, want)
		}
	}
}

// record encodes one inotify record the way the kernel does, the name
// padded with NULs to a multiple of 16 bytes.
func record(wd int32, mask, cookie uint32, name string) []byte {
	n := 0
	if name != "" {
		n = (len(name)/16 + 1) * 16
	}
	b := make([]byte, unix.SizeofInotifyEvent+n)
	binary.NativeEndian.PutUint32(b[0:], uint32(wd))
	binary.NativeEndian.PutUint32(b[4:], mask)
	binary.NativeEndian.PutUint32(b[8:], cookie)
	binary.NativeEndian.PutUint32(b[12:], uint32(n))
	copy(b[16:], name)
	return b
}

func TestParseEvents(t *testing.T) {
	buf := append(record(1, unix.IN_CREATE, 0, "exactly16bytes.."), record(2, unix.IN_DELETE_SELF, 0, "")...)
	buf = append(buf, record(3, unix.IN_MOVED_FROM, 7, "a")...)
	var got []rawEvent
	if err := parseEvents(buf, func(e rawEvent) { got = append(got, e) }); err != nil {
		t.Fatal(err)
	}
	want := []rawEvent{{1, unix.IN_CREATE, 0, "exactly16bytes.."}, {2, unix.IN_DELETE_SELF, 0, ""}, {3, unix.IN_MOVED_FROM, 7, "a"}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("parsed %v, want %v", got, want)
	}
	for _, bad := range [][]byte{buf[:len(buf)-1], buf[:10], record(1, 0, 0, "")[:15]} {
		if err := parseEvents(bad, func(rawEvent) {}); !errors.Is(err, errTruncated) {
			t.Errorf("truncated buffer of %d bytes: %v", len(bad), err)
		}
	}
	// A length that would overflow an int on addition.
	huge := record(1, 0, 0, "")
	binary.NativeEndian.PutUint32(huge[12:], 0xffffffff)
	if err := parseEvents(huge, func(rawEvent) {}); !errors.Is(err, errTruncated) {
		t.Errorf("huge length: %v", err)
	}
}

// FuzzParseEvents: whatever the bytes, the decoder neither panics nor
// reads past them, and the names it returns hold no NUL.
func FuzzParseEvents(f *testing.F) {
	f.Add(append(record(1, unix.IN_CREATE, 0, "name"), record(2, unix.IN_IGNORED, 0, "")...))
	f.Add(record(-1, unix.IN_Q_OVERFLOW, 0, ""))
	f.Add([]byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, b []byte) {
		total := 0
		parseEvents(b, func(e rawEvent) {
			if strings.IndexByte(e.name, 0) >= 0 {
				t.Fatalf("name %q holds a NUL", e.name)
			}
			total += unix.SizeofInotifyEvent + len(e.name)
		})
		if total > len(b) {
			t.Fatalf("decoded %d bytes from %d", total, len(b))
		}
	})
}

func TestValidName(t *testing.T) {
	for name, want := range map[string]bool{"a": true, "a b": true, "": false, ".": false, "..": false, "a/b": false, "a\x00": false, strings.Repeat("x", 256): false} {
		if validName(name) != want {
			t.Errorf("validName(%q) = %v", name, !want)
		}
	}
}
