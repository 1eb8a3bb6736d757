//go:build linux

package cgroups

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
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

// TestGroups starts a process into a group, checks that it and its child
// are told apart by their group, and that the group goes once they have.
func TestGroups(t *testing.T) {
	mount := cgroup2Root(t)
	var b [4]byte
	rand.Read(b[:])
	name := "carrel-test-" + hex.EncodeToString(b[:])
	d, err := Open(mount, name)
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

	const id = "0123456789abcdef"
	g, err := d.Create(id)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.Create(id); !errors.Is(err, os.ErrExist) {
		t.Errorf("a second Create of the same id: %v, want ErrExist", err)
	}
	// The child outlives the shell, as a daemon would.
	cmd := exec.Command("/bin/sh", "-c", "sleep 5 >/dev/null 2>&1 & echo $!")
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(g.Fd())}
	out, err := cmd.Output()
	g.Close()
	if err != nil {
		t.Fatal(err)
	}
	child, err := strconv.Atoi(strings.TrimSpace(string(out)))
	if err != nil {
		t.Fatal(err)
	}
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
