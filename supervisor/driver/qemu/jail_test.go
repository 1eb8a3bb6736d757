package qemu

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/carrel-os/carrel/supervisor/driver"
	"github.com/carrel-os/carrel/supervisor/jail"
)

func TestMain(m *testing.M) {
	jail.Main()
	os.Exit(m.Run())
}

func jailDriver(t *testing.T, binary string) *Driver {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("jails need root")
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return New(Config{Binary: binary, Jail: &Jail{Helper: self, UIDBase: 0x6000f000, UIDs: 16}})
}

// TestCheckJail: a program that runs in the jail passes, wherever it
// lives; one that runs and fails is QEMU's trouble, not the jail's; one
// the jail cannot start fails, saying so.
func TestCheckJail(t *testing.T) {
	for _, bin := range []string{"/bin/true", "/bin/false"} {
		if err := jailDriver(t, bin).CheckJail(t.TempDir()); err != nil {
			t.Errorf("%s: %v", bin, err)
		}
	}
	// A program outside /usr is shown to the jail.
	outside := filepath.Join(t.TempDir(), "qemu")
	b, err := os.ReadFile("/bin/true")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(outside, b, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := jailDriver(t, outside).CheckJail(t.TempDir()); err != nil {
		t.Errorf("%s: %v", outside, err)
	}
	// A helper that cannot build the jail (as under a unit without the
	// capabilities) says so, and carreld stops.
	d := jailDriver(t, "/bin/true")
	d.cfg.Jail.Helper = filepath.Join(t.TempDir(), "helper")
	if err := os.WriteFile(d.cfg.Jail.Helper, []byte("#!/bin/sh\necho 'carrel jail: mount: operation not permitted' >&2\nexit 126\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := d.CheckJail(t.TempDir()); err == nil || !strings.Contains(err.Error(), "cannot be jailed here: carrel jail: mount") {
		t.Errorf("a jail that cannot be built: %v", err)
	}
}

func TestJailBinds(t *testing.T) {
	dir := "/var/lib/carrel/vms/a"
	got := jailBinds(dir, []string{"/usr/bin/qemu", "/var/lib/carrel/images/k", dir + "/state.qcow2", "/var/lib/carrel/images/k", "/var/lib/carrel/vms/b/layer", "/nix/store/x-qemu/bin/qemu"})
	want := []string{"/var/lib/carrel/images/k", "/var/lib/carrel/vms/b/layer"}
	if len(got) != len(want) {
		t.Fatalf("binds %+v, want %v", got, want)
	}
	for i, b := range got {
		if b.Path != want[i] || b.Writable {
			t.Errorf("bind %d: %+v, want %s read-only", i, b, want[i])
		}
	}
}

func TestHandOver(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("hands files to another user: needs root")
	}
	dir := t.TempDir()
	disk, layer, kernel := filepath.Join(dir, "state.qcow2"), filepath.Join(dir, "old.qcow2"), filepath.Join(t.TempDir(), "vmlinuz")
	for _, f := range []string{disk, layer, kernel} {
		if err := os.WriteFile(f, nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	const uid = 0x6000f001
	os.Chown(layer, uid, uid) // a layer an earlier QEMU wrote
	spec := driver.Spec{Kernel: kernel, Initrd: kernel, Disks: []driver.Disk{{Path: disk, Layers: []string{layer}}}}
	if err := handOver(dir, uid, spec); err != nil {
		t.Fatal(err)
	}
	check := func(path string, wantUID, wantGID uint32, wantMode os.FileMode) {
		t.Helper()
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		st := statOf(fi)
		if st.uid != wantUID || st.gid != wantGID || fi.Mode().Perm() != wantMode {
			t.Errorf("%s: %d:%d %o, want %d:%d %o", path, st.uid, st.gid, fi.Mode().Perm(), wantUID, wantGID, wantMode)
		}
	}
	check(dir, 0, uid, 0o710)
	check(disk, uid, 0, 0o660)
	check(layer, 0, 0, 0o444)
	check(kernel, 0, 0, 0o444)
}

type owner struct{ uid, gid uint32 }

func statOf(fi os.FileInfo) owner {
	st := fi.Sys().(*syscall.Stat_t)
	return owner{st.Uid, st.Gid}
}

// TestProcUIDs: a process's users are found whatever owns its /proc
// directory.
func TestProcUIDs(t *testing.T) {
	used, err := procUIDs()
	if err != nil {
		t.Fatal(err)
	}
	if !used[uint32(os.Getuid())] {
		t.Errorf("this test's own user %d is not among %d users found", os.Getuid(), len(used))
	}
}
