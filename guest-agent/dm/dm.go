//go:build linux

// Package dm sets up device-mapper devices through the kernel's ioctl
// interface on /dev/mapper/control, without libdevmapper or udev. The guest
// agent, running as PID 1 in an initramfs with devtmpfs on /dev, uses it to
// put a read-only dm-verity device over the root image before mounting it.
//
// Contract:
//   - Only single-target tables, always loaded read-only.
//   - The kernel must already have device-mapper and the target type (for
//     verity, dm_mod and dm_verity) built in or loaded. This package loads
//     no modules: the kernel would try modprobe, which the initramfs lacks.
//   - No /dev/mapper/<name> links are made; callers use the /dev/dm-<minor>
//     node that CreateReadOnly returns.
//   - Errors from the kernel wrap its unix.Errno, so errors.Is(err,
//     unix.ENXIO) tells "no such device" and unix.EBUSY "in use or exists".
package dm

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Target is one line of a device-mapper table.
type Target struct {
	Start, Length uint64 // in 512-byte sectors
	Type          string // e.g. "verity" (at most 15 bytes)
	Params        string // the target's parameter string
}

// ErrNoDeviceMapper is returned when the kernel has no device-mapper:
// dm_mod is neither built in nor loaded.
var ErrNoDeviceMapper = errors.New("device-mapper is not available in this kernel")

const (
	controlPath = "/dev/mapper/control"
	// The control node's fixed misc minor (MAPPER_CTRL_MINOR); sysfs
	// says so too once dm_mod is in, and we prefer what sysfs says.
	controlMajor = 10
	controlMinor = 236
	controlSysfs = "/sys/class/misc/device-mapper/dev"

	devDir = "/dev"
	// nodeWait is how long CreateReadOnly waits for devtmpfs to make
	// /dev/dm-<minor> before making it itself.
	nodeWait = 2 * time.Second
)

// CreateReadOnly creates device name (at most 127 bytes, no '/'), loads t
// into it as a read-only table and resumes it, so that it is ready for I/O.
// It returns the device's dev_t, in unix.Mkdev's encoding, and the path of
// its block node, /dev/dm-<minor>: the one devtmpfs makes, or one it makes
// itself if devtmpfs has not within about 2 seconds.
//
// It fails with an error wrapping unix.EBUSY if name already exists, and
// then leaves that device alone. If any step after creating the device
// fails, it removes the device again; the error names the step and wraps
// the kernel's errno, e.g. `dm: load table for "root": invalid argument`.
func CreateReadOnly(name string, t Target) (dev uint64, path string, err error) {
	if err := checkName(name); err != nil {
		return 0, "", err
	}
	if err := checkTarget(t); err != nil {
		return 0, "", err
	}
	fd, err := openControl()
	if err != nil {
		return 0, "", err
	}
	defer unix.Close(fd)
	s := system{
		ioctl: func(cmd uint, buf []byte) error { return ioctl(fd, cmd, buf) },
		node:  func(dev uint64) (string, error) { return ensureNode(devDir, dev, nodeWait) },
	}
	return s.createReadOnly(name, t)
}

// Remove removes device name. It fails with an error wrapping unix.EBUSY
// while the device is open or mounted, and unix.ENXIO if there is none.
func Remove(name string) error {
	if err := checkName(name); err != nil {
		return err
	}
	fd, err := openControl()
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return remove(func(cmd uint, buf []byte) error { return ioctl(fd, cmd, buf) }, name)
}

// Status returns the status line of the single target of device name's
// live table (DM_TABLE_STATUS, not the table itself). For verity it starts
// with "V" (verified so far) or "C" (corruption seen); newer kernels append
// more, such as " -" when there is no forward error correction. It is an
// error if the device has no live table or more than one target.
func Status(name string) (string, error) {
	if err := checkName(name); err != nil {
		return "", err
	}
	fd, err := openControl()
	if err != nil {
		return "", err
	}
	defer unix.Close(fd)
	return status(func(cmd uint, buf []byte) error { return ioctl(fd, cmd, buf) }, name)
}

// system is what creating a device needs from the outside world; unit
// tests replace both.
type system struct {
	ioctl func(cmd uint, buf []byte) error
	node  func(dev uint64) (string, error)
}

func (s system) createReadOnly(name string, t Target) (uint64, string, error) {
	load, err := tableLoadRequest(name, t, unix.DM_READONLY_FLAG)
	if err != nil {
		return 0, "", err
	}
	create, err := newRequest(name, 0, headerSize)
	if err != nil {
		return 0, "", err
	}
	if err := s.ioctl(unix.DM_DEV_CREATE, create); err != nil {
		return 0, "", fmt.Errorf("dm: create %q: %w", name, err)
	}
	h, err := parseHeader(create)
	if err != nil {
		return 0, "", s.undo(name, fmt.Errorf("dm: create %q: %w", name, err))
	}
	dev := h.dev

	if err := s.ioctl(unix.DM_TABLE_LOAD, load); err != nil {
		return 0, "", s.undo(name, fmt.Errorf("dm: load table for %q: %w", name, err))
	}

	// DM_DEV_SUSPEND without DM_SUSPEND_FLAG resumes: it makes the
	// loaded table live.
	resume, err := newRequest(name, 0, headerSize)
	if err != nil {
		return 0, "", s.undo(name, err)
	}
	if err := s.ioctl(unix.DM_DEV_SUSPEND, resume); err != nil {
		return 0, "", s.undo(name, fmt.Errorf("dm: resume %q: %w", name, err))
	}
	// The kernel reports the disk's read-only state in the reply; a
	// writable device would break this package's one promise.
	if h, err := parseHeader(resume); err != nil || h.flags&unix.DM_READONLY_FLAG == 0 {
		return 0, "", s.undo(name, fmt.Errorf("dm: resume %q: the kernel did not make the device read-only", name))
	}

	path, err := s.node(dev)
	if err != nil {
		return 0, "", s.undo(name, fmt.Errorf("dm: device node for %q: %w", name, err))
	}
	return dev, path, nil
}

// undo removes the half-made device name and returns cause, joined with
// the removal's error if that failed too.
func (s system) undo(name string, cause error) error {
	return errors.Join(cause, remove(s.ioctl, name))
}

func remove(ioctl func(uint, []byte) error, name string) error {
	buf, err := newRequest(name, 0, headerSize)
	if err != nil {
		return err
	}
	if err := ioctl(unix.DM_DEV_REMOVE, buf); err != nil {
		return fmt.Errorf("dm: remove %q: %w", name, err)
	}
	return nil
}

func status(ioctl func(uint, []byte) error, name string) (string, error) {
	for size := statusBufSize; ; size *= 2 {
		// flags 0: DM_STATUS_TABLE_FLAG would return the table instead.
		buf, err := newRequest(name, 0, size)
		if err != nil {
			return "", err
		}
		if err := ioctl(unix.DM_TABLE_STATUS, buf); err != nil {
			return "", fmt.Errorf("dm: status of %q: %w", name, err)
		}
		targets, err := parseStatus(buf)
		if errors.Is(err, errBufferFull) && size < maxStatusBufSize {
			continue
		}
		if err != nil {
			return "", fmt.Errorf("dm: status of %q: %w", name, err)
		}
		if len(targets) != 1 {
			return "", fmt.Errorf("dm: status of %q: live table has %d targets, want 1", name, len(targets))
		}
		return targets[0].Status, nil
	}
}

// ioctl issues one device-mapper command on the control node fd. buf is
// both request and reply.
func ioctl(fd int, cmd uint, buf []byte) error {
	for {
		_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), uintptr(cmd), uintptr(unsafe.Pointer(&buf[0])))
		switch e {
		case 0:
			return nil
		case unix.EINTR:
			continue
		default:
			return e
		}
	}
}

// openControl opens /dev/mapper/control, first making the node if it is
// missing (as without devtmpfs, or before anything created it).
func openControl() (int, error) {
	fd, err := unix.Open(controlPath, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		if err := makeControlNode(); err != nil {
			return -1, err
		}
		fd, err = unix.Open(controlPath, unix.O_RDWR|unix.O_CLOEXEC, 0)
	}
	switch {
	case errors.Is(err, unix.ENODEV), errors.Is(err, unix.ENXIO):
		// The node exists but no driver is behind it.
		return -1, fmt.Errorf("dm: open %s: %w (%w)", controlPath, ErrNoDeviceMapper, err)
	case err != nil:
		return -1, fmt.Errorf("dm: open %s: %w", controlPath, err)
	}
	return fd, nil
}

func makeControlNode() error {
	major, minor := uint32(controlMajor), uint32(controlMinor)
	if b, err := os.ReadFile(controlSysfs); err == nil {
		if ma, mi, ok := parseMajorMinor(string(b)); ok {
			major, minor = ma, mi
		}
	}
	if err := os.MkdirAll(filepath.Dir(controlPath), 0o755); err != nil {
		return fmt.Errorf("dm: make control node: %w", err)
	}
	err := unix.Mknod(controlPath, unix.S_IFCHR|0o600, int(unix.Mkdev(major, minor)))
	if err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("dm: make control node %s: %w", controlPath, err)
	}
	return nil
}

// parseMajorMinor parses sysfs's "MAJOR:MINOR\n".
func parseMajorMinor(s string) (major, minor uint32, ok bool) {
	a, b, found := strings.Cut(strings.TrimSpace(s), ":")
	if !found {
		return 0, 0, false
	}
	ma, err1 := strconv.ParseUint(a, 10, 32)
	mi, err2 := strconv.ParseUint(b, 10, 32)
	if err1 != nil || err2 != nil {
		return 0, 0, false
	}
	return uint32(ma), uint32(mi), true
}

// ensureNode returns dir/dm-<minor> once it is the block device dev. It
// waits up to wait for devtmpfs to make it, then makes it itself. A file
// of that name that is anything else is an error: we do not remove what
// we did not make.
func ensureNode(dir string, dev uint64, wait time.Duration) (string, error) {
	path := filepath.Join(dir, "dm-"+strconv.FormatUint(uint64(unix.Minor(dev)), 10))
	deadline := time.Now().Add(wait)
	for {
		ok, err := isBlockNode(path, dev)
		if ok || (err != nil && !errors.Is(err, unix.ENOENT)) {
			return path, err
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	err := unix.Mknod(path, unix.S_IFBLK|0o600, int(dev))
	if errors.Is(err, unix.EEXIST) {
		// devtmpfs got there after all.
		_, err = isBlockNode(path, dev)
	} else if err != nil {
		err = &os.PathError{Op: "mknod", Path: path, Err: err}
	}
	if err != nil {
		return "", err
	}
	return path, nil
}

// isBlockNode reports whether path is the block device dev; it is an
// error if path exists but is something else.
func isBlockNode(path string, dev uint64) (bool, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return false, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK || uint64(st.Rdev) != dev {
		return false, fmt.Errorf("%s exists but is not block device %d:%d", path, unix.Major(dev), unix.Minor(dev))
	}
	return true, nil
}
