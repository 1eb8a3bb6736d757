//go:build linux

package cgroups

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestExecIDFrom(t *testing.T) {
	d := &Dir{rel: "/carrel"}
	tests := []struct {
		in   string
		id   string
		want bool
	}{
		{"0::/carrel/0123456789abcdef\n", "0123456789abcdef", true},
		{"12:pids:/\n1:name=systemd:/x\n0::/carrel/abc/deeper\n", "abc", true},
		{"0::/\n", "", false},
		{"0::/carrel\n", "", false},
		{"0::/carrel/\n", "", false},
		{"0::/carrelx/abc\n", "", false},
		{"0::/other/carrel/abc\n", "", false},
		{"0::/carrel/../abc\n", "", false},
		{"0::/carrel/a b\n", "", false},
		{"4:memory:/carrel/abc\n", "", false}, // not the unified hierarchy
		{"", "", false},
	}
	for _, tt := range tests {
		id, ok := d.execIDFrom([]byte(tt.in))
		if id != tt.id || ok != tt.want {
			t.Errorf("execIDFrom(%q) = %q, %v; want %q, %v", tt.in, id, ok, tt.id, tt.want)
		}
	}
}

func TestOpenRefusesWhatIsNotCgroup2(t *testing.T) {
	if _, err := Open(t.TempDir(), "carrel"); !errors.Is(err, ErrNotCgroup2) {
		t.Errorf("Open on a plain directory: %v, want ErrNotCgroup2", err)
	}
	if _, err := Open("/sys/fs/cgroup", "../x"); err == nil {
		t.Error("Open accepted a name with a slash")
	}
}

// cgroup2Root finds a cgroup v2 mount of the whole hierarchy, or skips.
func cgroup2Root(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to make cgroups")
	}
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		t.Skip(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		for i, fl := range fields {
			if fl == "-" && i+1 < len(fields) && fields[i+1] == "cgroup2" && fields[3] == "/" {
				return fields[4]
			}
		}
	}
	t.Skip("no cgroup v2 hierarchy mounted")
	return ""
}

// testDir makes a Dir of the test's own under the cgroup v2 hierarchy, or
// skips, and removes it and its groups at the end.
func testDir(t *testing.T) *Dir {
	t.Helper()
	mount := cgroup2Root(t)
	var b [4]byte
	rand.Read(b[:])
	d, err := Open(mount, "carrel-test-"+hex.EncodeToString(b[:]))
	if err != nil {
		t.Skipf("cannot make a cgroup under %s: %v", mount, err)
	}
	t.Cleanup(func() {
		entries, _ := os.ReadDir(d.Path())
		for _, e := range entries {
			if e.IsDir() {
				os.Remove(filepath.Join(d.Path(), e.Name()))
			}
		}
		if err := os.Remove(d.Path()); err != nil {
			t.Errorf("remove the test's cgroup: %v", err)
		}
	})
	return d
}

// startIn starts, in group g, a shell that leaves a child behind (as a
// daemon would), and returns the child's pid.
func startIn(t *testing.T, g *Group) int {
	t.Helper()
	cmd := exec.Command("/bin/sh", "-c", "sleep 5 >/dev/null 2>&1 & echo $!")
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: g.FD()}
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	child, err := strconv.Atoi(strings.TrimSpace(string(out)))
	if err != nil {
		t.Fatal(err)
	}
	return child
}

// TestKeptGroups: Release keeps an empty group for Take, which gives it to
// another command: ExecID then names that command. A busy group, or one
// not to keep, is removed as Remove does.
func TestKeptGroups(t *testing.T) {
	d := testDir(t)
	const first, second, third = "0123456789abcdef", "1111111111111111", "2222222222222222"
	if _, ok := d.Take(second); ok {
		t.Fatal("Take gave a group when none was kept")
	}
	if _, err := d.Create(first); err != nil {
		t.Fatal(err)
	}
	d.Release(first, true)
	if _, err := os.Stat(filepath.Join(d.Path(), first)); err != nil {
		t.Fatalf("an empty group to keep was removed: %v", err)
	}
	g, ok := d.Take(second)
	if !ok || g.Name != first {
		t.Fatalf("Take = %v, %v; want the kept group %q", g, ok, first)
	}
	name := g.Name
	if _, ok := d.Take(third); ok {
		t.Fatal("Take gave the same group twice")
	}
	child := startIn(t, g)
	killed := false
	t.Cleanup(func() {
		if !killed {
			syscall.Kill(child, syscall.SIGKILL)
		}
	})
	if got, ok := d.ExecID(child); !ok || got != second {
		t.Errorf("ExecID of a process in the kept group = %q, %v; want its holder %q", got, ok, second)
	}
	// Busy (the child lives on): not kept, and still its holder's.
	d.Release(name, true)
	if _, ok := d.Take(third); ok {
		t.Error("a busy group was kept")
	}
	if got, ok := d.ExecID(child); !ok || got != second {
		t.Errorf("ExecID in a busy group after its command = %q, %v; want %q", got, ok, second)
	}
	syscall.Kill(child, syscall.SIGKILL)
	killed = true
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		d.Sweep()
		if _, err := os.Stat(filepath.Join(d.Path(), name)); errors.Is(err, os.ErrNotExist) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the busy group was not removed once empty")
		}
	}
	d.mu.Lock()
	_, held := d.holder[name]
	d.mu.Unlock()
	if held {
		t.Errorf("the removed group %s still has a holder", name)
	}
	// Empty, but its command ran as root: removed.
	if _, err := d.Create(third); err != nil {
		t.Fatal(err)
	}
	d.Release(third, false)
	if _, err := os.Stat(filepath.Join(d.Path(), third)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a group not to keep is still there: %v", err)
	}
	// At most maxFree are kept.
	for i := range maxFree + 2 {
		id := fmt.Sprintf("%016x", i+1)
		if _, err := d.Create(id); err != nil {
			t.Fatal(err)
		}
		d.Release(id, true)
	}
	entries, _ := os.ReadDir(d.Path())
	groups := 0
	for _, e := range entries {
		if e.IsDir() {
			groups++
		}
	}
	if groups != maxFree {
		t.Errorf("%d groups kept, want %d", groups, maxFree)
	}
	// A process in a kept group belongs to no command (only root can put
	// one there).
	kept := fmt.Sprintf("%016x", 1)
	if id, ok := d.execIDFrom([]byte("0::/" + filepath.Base(d.Path()) + "/" + kept + "\n")); ok {
		t.Errorf("a process in the kept group %s is said to be command %q's", kept, id)
	}
	// A frozen group is not kept.
	g, err := d.Create(first)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(d.Path(), first, "cgroup.freeze"), []byte("1"), 0); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(readFile(t, filepath.Join(d.Path(), first, "cgroup.events")), "frozen 1"); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the group did not freeze")
		}
	}
	if g.Empty() {
		t.Error("a frozen group counts as one to keep")
	}
}

func readFile(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestGroups starts a process into a group, checks that it and its child
// are told apart by their group, and that the group goes once they have.
func TestGroups(t *testing.T) {
	d := testDir(t)

	const id = "0123456789abcdef"
	g, err := d.Create(id)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.Create(id); !errors.Is(err, os.ErrExist) {
		t.Errorf("a second Create of the same id: %v, want ErrExist", err)
	}
	// The child outlives the shell, as a daemon would.
	child := startIn(t, g)
	if got, ok := d.ExecID(child); !ok || got != id {
		t.Errorf("ExecID of the command's child = %q, %v; want %q", got, ok, id)
	}
	if _, ok := d.ExecID(os.Getpid()); ok {
		t.Error("the test process itself is in a command's group")
	}
	d.Remove(id) // busy: kept for later
	if _, err := os.Stat(filepath.Join(d.Path(), id)); err != nil {
		t.Fatalf("a busy group was removed: %v", err)
	}
	syscall.Kill(child, syscall.SIGKILL)
	deadline := time.Now().Add(5 * time.Second)
	for {
		d.Sweep()
		if _, err := os.Stat(filepath.Join(d.Path(), id)); errors.Is(err, os.ErrNotExist) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the group was not removed once empty")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestTakePassesOverChangedGroups: a kept group that root in the guest
// removed, froze, or put a process in, since it was kept is not given to
// a command; Take gives the next kept group instead. The process root put
// there is no command's.
func TestTakePassesOverChangedGroups(t *testing.T) {
	d := testDir(t)
	const a, b, c, f, holder = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb", "cccccccccccccccc", "ffffffffffffffff", "dddddddddddddddd"
	for _, id := range []string{a, f, b, c} {
		if _, err := d.Create(id); err != nil {
			t.Fatal(err)
		}
		d.Release(id, true)
	}
	// Taken last in, first out: c, b, then f. Root removes c, fills b
	// and freezes f.
	if err := os.Remove(filepath.Join(d.Path(), c)); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(d.Path(), f, "cgroup.freeze"), []byte("1"), 0); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.WriteFile(filepath.Join(d.Path(), f, "cgroup.freeze"), []byte("0"), 0) })
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(readFile(t, filepath.Join(d.Path(), f, "cgroup.events")), "frozen 1"); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the group did not freeze")
		}
	}
	cmd := exec.Command("/bin/sh", "-c", "sleep 5 >/dev/null 2>&1 & echo $!")
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: d.open[b].FD()}
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	child, _ := strconv.Atoi(strings.TrimSpace(string(out)))
	t.Cleanup(func() { // before testDir's: the group must be empty to go
		syscall.Kill(child, syscall.SIGKILL)
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			if err := os.Remove(filepath.Join(d.Path(), b)); err == nil || errors.Is(err, os.ErrNotExist) {
				return
			}
		}
	})

	g, ok := d.Take(holder)
	if !ok || g.Name != a {
		t.Fatalf("Take = %v, %v; want the unchanged group %s", g, ok, a)
	}
	if _, ok := d.Take(holder); ok {
		t.Error("Take gave a second group; the changed ones should be gone from the kept list")
	}
	d.mu.Lock()
	_, bOpen := d.open[b]
	_, cOpen := d.open[c]
	_, fOpen := d.open[f]
	leftover := slices.Contains(d.leftover, b)
	d.mu.Unlock()
	if bOpen || cOpen || fOpen {
		t.Errorf("changed groups still held open: %s %v, %s %v, %s %v", b, bOpen, c, cOpen, f, fOpen)
	}
	if !leftover {
		t.Errorf("the busy group %s is not left for Sweep", b)
	}
	if id, ok := d.ExecID(child); ok {
		t.Errorf("the process root put in the kept group %s is said to be command %q's", b, id)
	}
}

// TestGroupsCloseWhatTheyOpen: a group made and removed leaves no
// descriptor open, and a kept one holds its two until it is removed.
func TestGroupsCloseWhatTheyOpen(t *testing.T) {
	d := testDir(t)
	fds := func() int {
		entries, err := os.ReadDir("/proc/self/fd")
		if err != nil {
			t.Fatal(err)
		}
		return len(entries)
	}
	before := fds()
	for i := range 20 {
		id := fmt.Sprintf("%016x", i+1)
		if _, err := d.Create(id); err != nil {
			t.Fatal(err)
		}
		d.Release(id, false)
	}
	if n := fds(); n != before {
		t.Errorf("%d descriptors open after 20 groups made and removed, %d before", n, before)
	}
	if _, err := d.Create(fmt.Sprintf("%016x", 99)); err != nil {
		t.Fatal(err)
	}
	d.Release(fmt.Sprintf("%016x", 99), true)
	if n := fds(); n != before+2 {
		t.Errorf("a kept group holds %d descriptors, want 2", n-before)
	}
	d.Remove(fmt.Sprintf("%016x", 99))
	if n := fds(); n != before {
		t.Errorf("%d descriptors open once the kept group is removed, %d before", n, before)
	}
}

// TestReleaseTwiceAndRemoveKept: releasing a kept group again keeps it
// once, and a kept group that is removed is no longer given by Take.
func TestReleaseTwiceAndRemoveKept(t *testing.T) {
	d := testDir(t)
	const a, b, holder = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb", "dddddddddddddddd"
	for _, id := range []string{a, b} {
		if _, err := d.Create(id); err != nil {
			t.Fatal(err)
		}
		d.Release(id, true)
	}
	d.Release(b, true)
	d.Release(b, false) // kept already: not removed either
	d.mu.Lock()
	kept := len(d.free)
	d.mu.Unlock()
	if kept != 2 {
		t.Fatalf("%d groups kept after releasing one again, want 2", kept)
	}
	d.Remove(b)
	d.mu.Lock()
	kept = len(d.free)
	d.mu.Unlock()
	if kept != 1 {
		t.Errorf("%d groups kept after one of two was removed, want 1", kept)
	}
	g, ok := d.Take(holder)
	if !ok || g.Name != a {
		t.Fatalf("Take = %v, %v; want %s, the group still kept", g, ok, a)
	}
	if g, ok := d.Take(holder); ok {
		t.Errorf("Take gave the removed group %s", g.Name)
	}
}
