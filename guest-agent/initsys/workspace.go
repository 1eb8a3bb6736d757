//go:build linux

package initsys

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// ErrWorkspace means /workspace could not be set up on the disk carreld
// gave the VM. The agent does not serve without it: writes would land in
// the initramfs, in memory, unbounded and lost at stop.
var ErrWorkspace = errors.New("workspace disk")

// ext4ResizeFS is EXT4_IOC_RESIZE_FS, _IOW('f', 16, __u64): grow a mounted
// ext4 file system to the given number of blocks.
const ext4ResizeFS = 0x40086610

// diskTimeout bounds the wait for the workspace disk to appear once its
// driver (virtio_blk) is loaded.
const diskTimeout = 10 * time.Second

// Service does, for carrel-agent run as a service of the image's init
// (--system), the part of Setup that the init system does not: it mounts
// the workspace disk on /workspace when the kernel command line says so
// and nothing is mounted there yet (the error wraps ErrWorkspace).
func Service(log *slog.Logger) error {
	cmdline, err := os.ReadFile("/proc/cmdline")
	if err != nil {
		return fmt.Errorf("%w: %w", ErrWorkspace, err)
	}
	if !WorkspaceOnDisk(string(cmdline)) || mounted("/workspace") {
		return nil
	}
	return mountWorkspaceDisk(log)
}

// WorkspaceOnDisk reports whether the kernel command line puts /workspace
// on the workspace disk (protocol.WorkspaceDiskArg).
func WorkspaceOnDisk(cmdline string) bool {
	for _, f := range strings.Fields(cmdline) {
		if f == protocol.WorkspaceDiskArg {
			return true
		}
	}
	return false
}

// findDisk returns the name (vda) of the block device under sysBlock
// (/sys/block) whose serial is serial, waiting up to timeout for it.
func findDisk(sysBlock, serial string, timeout time.Duration) (string, error) {
	deadline := time.Now().Add(timeout)
	for {
		ents, _ := os.ReadDir(sysBlock)
		for _, e := range ents {
			b, err := os.ReadFile(filepath.Join(sysBlock, e.Name(), "serial"))
			if err == nil && strings.TrimSpace(string(b)) == serial {
				return e.Name(), nil
			}
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("no block device with serial %q in %s after %s", serial, sysBlock, timeout)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// mountWorkspaceDisk mounts the workspace disk (ext4, see image/workspace)
// on /workspace, grown to the disk's size, which is the workspace's size:
// carreld sizes the disk, the template is small.
func mountWorkspaceDisk(log *slog.Logger) error {
	if err := mountExt4Disk(log, protocol.WorkspaceSerial, "/workspace"); err != nil {
		return fmt.Errorf("%w: %w", ErrWorkspace, err)
	}
	// mke2fs's lost+found is of no use to the agent's user, who cannot
	// open it; an e2fsck that needs it makes it again.
	if err := os.Remove("/workspace/lost+found"); err != nil && !errors.Is(err, os.ErrNotExist) && !errors.Is(err, unix.ENOTEMPTY) {
		log.Warn("remove /workspace/lost+found", "err", err)
	}
	return nil
}

// mountExt4Disk mounts the ext4 file system of the disk whose serial is
// serial on target and grows it to the disk's size (image/workspace's
// template is small, and carreld sizes each VM's disk).
func mountExt4Disk(log *slog.Logger, serial, target string) error {
	name, err := findDisk("/sys/block", serial, diskTimeout)
	if err != nil {
		return err
	}
	dev := "/dev/" + name
	if err := os.MkdirAll(target, 0o755); err != nil {
		return err
	}
	// noinit_itable: the inode tables a resize adds are not zeroed in the
	// background, which would fill the host's sparse disk file with zeros;
	// ext4 records which inodes were never used, so it needs no zeroes.
	if err := unix.Mount(dev, target, "ext4", nodevNosuid, "noinit_itable"); err != nil {
		return fmt.Errorf("mount %s (ext4) on %s: %w", dev, target, err)
	}
	sectors, err := diskSectors(name)
	if err != nil {
		return err
	}
	var st unix.Statfs_t
	if err := unix.Statfs(target, &st); err != nil || st.Bsize <= 0 {
		return fmt.Errorf("statfs %s: %v", target, err)
	}
	blocks := sectors * 512 / uint64(st.Bsize)
	if err := resizeExt4(target, blocks); err != nil {
		return fmt.Errorf("grow the file system on %s to %d blocks: %w", dev, blocks, err)
	}
	log.Info("disk mounted", "serial", serial, "on", target, "device", dev, "bytes", sectors*512)
	return nil
}

// diskSectors is the size of disk name (vda) in 512-byte sectors, which
// /sys/block/NAME/size counts whatever the device's sector size.
func diskSectors(name string) (uint64, error) {
	b, err := os.ReadFile(filepath.Join("/sys/block", name, "size"))
	if err != nil {
		return 0, err
	}
	n, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("size of /dev/%s: %w", name, err)
	}
	return n, nil
}

// resizeExt4 grows the ext4 file system mounted at dir to blocks blocks;
// at its size already, it does nothing.
func resizeExt4(dir string, blocks uint64) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	n := blocks
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), ext4ResizeFS, uintptr(unsafe.Pointer(&n))); e != 0 {
		return e
	}
	return nil
}
