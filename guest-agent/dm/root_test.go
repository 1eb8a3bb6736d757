//go:build linux

package dm

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// requireDeviceMapper skips unless the test can really make dm devices:
// root, a kernel with device-mapper and its control node, and loop devices.
func requireDeviceMapper(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to create device-mapper devices")
	}
	if _, err := os.Stat(controlPath); err != nil {
		t.Skipf("no %s (device-mapper not built in or dm_mod not loaded): %v", controlPath, err)
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		t.Skipf("no loop devices: %v", err)
	}
}

// loopDevice attaches a new loop device to file, read-only, and detaches
// it at the end of the test.
func loopDevice(t *testing.T, file string) string {
	t.Helper()
	ctl, err := unix.Open("/dev/loop-control", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Skipf("open /dev/loop-control: %v", err)
	}
	defer unix.Close(ctl)
	n, err := unix.IoctlRetInt(ctl, unix.LOOP_CTL_GET_FREE)
	if err != nil {
		t.Skipf("no free loop device: %v", err)
	}
	path := fmt.Sprintf("/dev/loop%d", n)
	loop, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Skipf("open %s: %v", path, err)
	}
	backing, err := unix.Open(file, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		unix.Close(loop)
		t.Fatal(err)
	}
	defer unix.Close(backing)
	if err := unix.IoctlSetInt(loop, unix.LOOP_SET_FD, backing); err != nil {
		unix.Close(loop)
		t.Skipf("attach %s: %v", path, err)
	}
	t.Cleanup(func() {
		unix.IoctlSetInt(loop, unix.LOOP_CLR_FD, 0)
		unix.Close(loop)
	})
	return path
}

func TestCreateReadOnlyRoot(t *testing.T) {
	requireDeviceMapper(t)
	data := bytes.Repeat([]byte("carrel-dm-test\n"), 1<<16) // just under 1 MiB
	data = data[:len(data)/512*512]
	file := filepath.Join(t.TempDir(), "image")
	if err := os.WriteFile(file, data, 0o600); err != nil {
		t.Fatal(err)
	}
	loop := loopDevice(t, file)
	sectors := uint64(len(data) / 512)
	name := fmt.Sprintf("carrel-dm-test-%d", os.Getpid())

	dev, path, err := CreateReadOnly(name, Target{Length: sectors, Type: "linear", Params: loop + " 0"})
	if err != nil {
		t.Fatal(err)
	}
	removed := false
	t.Cleanup(func() {
		if !removed {
			Remove(name)
		}
	})
	t.Logf("%s: dev %d:%d at %s", name, unix.Major(dev), unix.Minor(dev), path)

	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK || uint64(st.Rdev) != dev {
		t.Errorf("%s: mode %#o rdev %#x, want block device %#x", path, st.Mode, st.Rdev, dev)
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Errorf("read %d bytes through %s that differ from the image", len(got), path)
	}
	if f, err := os.OpenFile(path, os.O_WRONLY, 0); err == nil {
		f.Close()
		t.Errorf("%s opened for writing", path)
	}
	if s, err := Status(name); err != nil || s != "" {
		t.Errorf("Status = %q, %v; want the linear target's empty line", s, err)
	}

	if _, _, err := CreateReadOnly(name, Target{Length: 1, Type: "error"}); !errors.Is(err, unix.EBUSY) {
		t.Errorf("creating %s twice: %v, want EBUSY", name, err)
	}
	if _, err := Status(name); err != nil {
		t.Errorf("the failed second create harmed the first device: %v", err)
	}

	bad := name + "-bad"
	_, _, err = CreateReadOnly(bad, Target{Length: sectors, Type: "linear", Params: "/dev/no-such-disk 0"})
	if err == nil {
		Remove(bad)
		t.Fatal("table over a missing disk loaded")
	}
	t.Logf("bad table: %v", err)
	if _, serr := Status(bad); !errors.Is(serr, unix.ENXIO) {
		t.Errorf("after a failed load, Status(%q) = %v; want ENXIO (device removed)", bad, serr)
	}

	if err := Remove(name); err != nil {
		t.Fatal(err)
	}
	removed = true
	if _, err := Status(name); !errors.Is(err, unix.ENXIO) {
		t.Errorf("after Remove, Status = %v; want ENXIO", err)
	}
	if err := Remove(name); !errors.Is(err, unix.ENXIO) {
		t.Errorf("second Remove = %v; want ENXIO", err)
	}
}
