package qemu

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// fakeCgroupRoot lays out a delegated cgroup v2 subtree in a plain
// directory: what openHostCgroup reads and writes, without the kernel.
func fakeCgroupRoot(t *testing.T, controllers string) (mount, self string) {
	t.Helper()
	mount = t.TempDir()
	self = "/system.slice/carreld.service"
	base := filepath.Join(mount, self)
	if err := os.MkdirAll(base, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, body := range map[string]string{"cgroup.controllers": controllers, "cgroup.procs": "4242\n4343\n", "cgroup.subtree_control": ""} {
		if err := os.WriteFile(filepath.Join(base, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return mount, self
}

func read(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestHostCgroup: carreld's processes move to a leaf, the controllers are
// enabled below its group, and a VM's group gets limits from its size. The
// kernel's side of this (a real cgroup v2 host with delegation) is not
// exercised here: this machine is a cgroup v1 hybrid.
func TestHostCgroup(t *testing.T) {
	mount, self := fakeCgroupRoot(t, "cpuset cpu io memory pids\n")
	yes := func(string) bool { return true }
	h, err := openHostCgroup(mount, self, yes)
	if err != nil {
		t.Fatal(err)
	}
	base := filepath.Join(mount, self)
	// A plain file keeps only the last pid written; the kernel takes each.
	if got := read(t, filepath.Join(base, "supervisor", "cgroup.procs")); got != "4343" {
		t.Errorf("moved %q", got)
	}
	if got := read(t, filepath.Join(base, "cgroup.subtree_control")); got != "+memory +cpu +pids" {
		t.Errorf("subtree_control %q", got)
	}
	f, path, err := h.create(vmCgroupName("/var/lib/carrel/vms/demo"), 512<<20, 2, "tcg")
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	if path != filepath.Join(base, "vm-demo") {
		t.Errorf("path %s", path)
	}
	for file, want := range map[string]string{
		"memory.max": "2147483648", // 512 MiB + 1.5 GiB under TCG
		"cpu.max":    "300000 100000",
		"pids.max":   "288",
	} {
		if got := read(t, filepath.Join(path, file)); got != want {
			t.Errorf("%s = %q, want %q", file, got, want)
		}
	}
	// removeCgroup removes an empty group (here, once the fake files go).
	for _, f := range []string{"memory.max", "cpu.max", "pids.max"} {
		os.Remove(filepath.Join(path, f))
	}
	if err := removeCgroup(path); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("group still there: %v", err)
	}
	if err := removeCgroup(path); err != nil {
		t.Errorf("removing a group that is gone: %v", err)
	}
}

func TestHostCgroupRefusals(t *testing.T) {
	mount, self := fakeCgroupRoot(t, "cpu io pids\n")
	if _, err := openHostCgroup(mount, self, func(string) bool { return false }); err == nil || !strings.Contains(err.Error(), "not a cgroup v2") {
		t.Errorf("v1 host: %v", err)
	}
	if _, err := openHostCgroup(mount, self, func(string) bool { return true }); err == nil || !strings.Contains(err.Error(), "controller memory") || !strings.Contains(err.Error(), "Delegate=yes") {
		t.Errorf("no memory controller: %v", err)
	}
}
