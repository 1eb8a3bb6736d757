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
// on /workspace and grows its file system to the disk's size, which is
// the workspace's size: carreld sizes the disk, the template is small.
func mountWorkspaceDisk(log *slog.Logger) error {
	name, err := findDisk("/sys/block", protocol.WorkspaceSerial, diskTimeout)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrWorkspace, err)
	}
	dev := "/dev/" + name
	if err := os.MkdirAll("/workspace", 0o755); err != nil {
		return fmt.Errorf("%w: %w", ErrWorkspace, err)
	}
	// noinit_itable: the inode tables a resize adds are not zeroed in the
	// background, which would fill the host's sparse disk file with zeros;
	// ext4 records which inodes were never used, so it needs no zeroes.
	if err := unix.Mount(dev, "/workspace", "ext4", nodevNosuid, "noinit_itable"); err != nil {
		return fmt.Errorf("%w: mount %s (ext4) on /workspace: %w", ErrWorkspace, dev, err)
	}
	// /sys/block/NAME/size counts 512-byte sectors, whatever the device's.
	b, err := os.ReadFile(filepath.Join("/sys/block", name, "size"))
	if err != nil {
		return fmt.Errorf("%w: %w", ErrWorkspace, err)
	}
	sectors, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return fmt.Errorf("%w: size of %s: %w", ErrWorkspace, dev, err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs("/workspace", &st); err != nil || st.Bsize <= 0 {
		return fmt.Errorf("%w: statfs /workspace: %v", ErrWorkspace, err)
	}
	blocks := sectors * 512 / uint64(st.Bsize)
	if err := resizeExt4("/workspace", blocks); err != nil {
		return fmt.Errorf("%w: grow the file system on %s to %d blocks: %w", ErrWorkspace, dev, blocks, err)
	}
	// mke2fs's lost+found is of no use to the agent's user, who cannot
	// open it; an e2fsck that needs it makes it again.
	if err := os.Remove("/workspace/lost+found"); err != nil && !errors.Is(err, os.ErrNotExist) && !errors.Is(err, unix.ENOTEMPTY) {
		log.Warn("remove /workspace/lost+found", "err", err)
	}
	log.Info("workspace on disk", "device", dev, "bytes", sectors*512)
	return nil
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
