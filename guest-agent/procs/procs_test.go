//go:build linux

package procs

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"unicode/utf8"
)

func TestListSelf(t *testing.T) {
	ps, err := List("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var self *Process
	for i, p := range ps {
		if i > 0 && ps[i-1].Pid >= p.Pid {
			t.Fatalf("not ordered by pid: %d then %d", ps[i-1].Pid, p.Pid)
		}
		if p.Pid == os.Getpid() {
			self = &ps[i]
		}
		if p.Pid == 2 || p.PPid == 2 {
			t.Errorf("kernel thread listed: %+v", p)
		}
	}
	if self == nil {
		t.Fatalf("own pid %d not in %d processes", os.Getpid(), len(ps))
	}
	if self.PPid != os.Getppid() || self.UID != uint32(os.Geteuid()) || self.RSSBytes == 0 ||
		!strings.Contains(self.Command, filepath.Base(os.Args[0])) || self.State == "" {
		t.Fatalf("self %+v", self)
	}
	if pg, _ := syscall.Getpgid(0); self.Pgid != pg {
		t.Fatalf("pgid %d, want %d", self.Pgid, pg)
	}
}

// TestFakeProc: a hand-made /proc with a kernel thread, a zombie, odd
// names and a process that vanished.
func TestFakeProc(t *testing.T) {
	root := t.TempDir()
	write := func(pid, name, data string) {
		dir := filepath.Join(root, pid)
		os.MkdirAll(dir, 0o755)
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("2", "stat", "2 (kthreadd) S 0 0 0 0 -1 2129984 0 0")
	write("2", "cmdline", "")
	write("10", "stat", "10 (a (b) c) S 1 10 10 0 -1 4194560 0 0")
	write("10", "cmdline", "sh\x00-c\x00echo \xff\x00")
	write("10", "status", "Name:\tsh\nUid:\t1000\t1001\t1000\t1000\nGid:\t0\t0\t0\t0\n")
	write("10", "statm", "100 7 3 1 0 5 0\n")
	write("11", "stat", "11 (zed) Z 10 10 10 0 -1 4194564 0 0")
	write("11", "cmdline", "")
	write("12", "cmdline", "gone") // no stat: exited meanwhile
	os.MkdirAll(filepath.Join(root, "self"), 0o755)

	ps, err := List(root)
	if err != nil {
		t.Fatal(err)
	}
	if len(ps) != 2 {
		t.Fatalf("got %+v", ps)
	}
	p := ps[0]
	if p.Pid != 10 || p.PPid != 1 || p.Pgid != 10 || p.Sid != 10 || p.UID != 1001 || p.State != "S" ||
		p.Command != "sh -c echo \uFFFD" || p.RSSBytes != 7*uint64(os.Getpagesize()) {
		t.Fatalf("got %+v", p)
	}
	if z := ps[1]; z.Pid != 11 || z.State != "Z" || z.Command != "[zed]" {
		t.Fatalf("zombie %+v", z)
	}
}

func TestCut(t *testing.T) {
	if got := cut("héllo", 4); got != "h..." {
		t.Fatalf("%q", got)
	}
	if got := cut("ééé", 5); got != "é..." || !utf8.ValidString(got) {
		t.Fatalf("%q", got)
	}
	if got := cut("ééé", 4); got != "..." || cut("abc", 3) != "abc" {
		t.Fatalf("%q", got)
	}
}
