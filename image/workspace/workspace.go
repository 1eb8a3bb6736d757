// Package workspace makes the VMs' workspace disks. An image may carry a
// workspace template, a small raw ext4 file system built reproducibly at
// image build time (Template). Each VM gets a copy-on-write qcow2 disk of
// its own whose backing file is the template (Create): the VMs share the
// template's blocks and each disk holds only its VM's writes. The disk's
// size is the workspace's size, a cap set on the host. The guest finds the
// disk by its serial (protocol.WorkspaceSerial), mounts it on /workspace
// and grows the file system to fill it (an online resize), so one template
// serves every size.
package workspace

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/carrel-os/carrel/supervisor/atomicfile"
)

const (
	// TemplateSize is the template's size, the smallest workspace.
	TemplateSize = 16 << 20
	// MaxSize is the largest workspace: the template reserves the group
	// descriptor blocks an online resize to it needs.
	MaxSize = 1 << 40
	// blockSize is the file system's block size. A small file system
	// would otherwise get 1 KiB blocks, and keep them as it grows.
	blockSize = 4096
	// inodes is the template's inode count: its one block group's, which
	// every group added by a resize gets too. 8192 in a group of 32768
	// blocks is one inode per 16 KiB, mke2fs's default ratio for a disk
	// of the full size.
	inodes = 8192
	// The file system's UUID and directory hash seed, and the time stamped
	// on it, are fixed, so that a build gives the same bytes every time.
	fsUUID   = "6361726c-7773-4000-8000-000000000001"
	hashSeed = "6361726c-7773-4000-8000-000000000002"
	fakeTime = "1"
	// AgentUID owns the file system's root: the guest's unprivileged user
	// that commands run as.
	AgentUID = 1000
	// Label is the file system's label.
	Label = "workspace"
)

// Template writes the workspace template, an empty ext4 file system of
// TemplateSize owned by AgentUID, to path, replacing what is there. It
// runs mkfs.ext4 (e2fsprogs); the same e2fsprogs gives the same bytes.
func Template(ctx context.Context, path string) error {
	tmp := path + ".tmp"
	os.Remove(tmp)
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return fmt.Errorf("workspace template: %w", err)
	}
	err = f.Truncate(TemplateSize)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = run(ctx, []string{"E2FSPROGS_FAKE_TIME=" + fakeTime}, "mkfs.ext4", "-q", "-F",
			"-b", strconv.Itoa(blockSize), "-N", strconv.Itoa(inodes),
			// No blocks reserved for root: the workspace is the agent's.
			"-m", "0", "-L", Label, "-U", fsUUID,
			"-E", fmt.Sprintf("hash_seed=%s,root_owner=%d:%d,lazy_itable_init=0,lazy_journal_init=0,nodiscard,resize=%d",
				hashSeed, AgentUID, AgentUID, MaxSize/blockSize),
			tmp)
	}
	if err == nil {
		err = syncFile(tmp)
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err == nil {
		err = atomicfile.SyncDir(filepath.Dir(path))
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("workspace template: %w", err)
	}
	return nil
}

// syncFile makes a file durable.
func syncFile(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", path, err)
	}
	return nil
}

// QEMUImg returns the qemu-img beside the QEMU binary qemu when that is a
// path (as on NixOS, where neither is on carreld's PATH), else "qemu-img".
func QEMUImg(qemu string) string {
	if strings.Contains(qemu, "/") {
		return filepath.Join(filepath.Dir(qemu), "qemu-img")
	}
	return "qemu-img"
}

// Create makes the workspace disk at path: a qcow2 image of size bytes
// whose backing file is template (raw), by qemu-img. It fails if path
// exists. size must be a whole number of MiB from TemplateSize to MaxSize.
func Create(ctx context.Context, qemuImg, path, template string, size uint64) error {
	if size < TemplateSize || size > MaxSize || size%(1<<20) != 0 {
		return fmt.Errorf("workspace disk of %d bytes: want whole MiB, %d MiB to %d GiB", size, TemplateSize>>20, MaxSize>>30)
	}
	if !filepath.IsAbs(template) {
		return fmt.Errorf("workspace template %q: want an absolute path (the disk records it)", template)
	}
	if _, err := os.Lstat(path); err == nil {
		return fmt.Errorf("workspace disk %s: %w", path, os.ErrExist)
	}
	if err := overlay(ctx, qemuImg, path, template, "raw", size); err != nil {
		return fmt.Errorf("create workspace disk: %w", err)
	}
	return nil
}

// Overlay makes a qcow2 disk at path over backing, another qcow2 disk
// (a frozen layer of a snapshot), of size bytes. Like Create, it is made
// under a temporary name, synced and renamed.
func Overlay(ctx context.Context, qemuImg, path, backing string, size uint64) error {
	if !filepath.IsAbs(backing) {
		return fmt.Errorf("disk layer %q: want an absolute path (the disk records it)", backing)
	}
	if _, err := os.Lstat(path); err == nil {
		return fmt.Errorf("disk %s: %w", path, os.ErrExist)
	}
	if err := overlay(ctx, qemuImg, path, backing, "qcow2", size); err != nil {
		return fmt.Errorf("create disk over %s: %w", backing, err)
	}
	return nil
}

// overlay makes the qcow2 file at path over backing, of format
// backingFormat, of size bytes. It is made under a temporary name, synced
// and renamed: a crash part-way leaves no half disk that a later boot
// would take for the VM's.
func overlay(ctx context.Context, qemuImg, path, backing, backingFormat string, size uint64) error {
	tmp := path + ".tmp"
	os.Remove(tmp)
	// -u: the size is given, so qemu-img need not open the backing chain,
	// whose names in a VM's own layers its QEMU wrote (and could point
	// anywhere, for a root qemu-img to open).
	err := run(ctx, nil, qemuImg, "create", "-q", "-f", "qcow2", "-u", "-F", backingFormat, "-b", backing, tmp, strconv.FormatUint(size, 10))
	if err == nil {
		err = syncFile(tmp)
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
		return err
	}
	return atomicfile.SyncDir(filepath.Dir(path))
}

// Info is what qemu-img says of a disk.
type Info struct {
	Format          string `json:"format"`
	VirtualSize     uint64 `json:"virtual-size"`
	BackingFilename string `json:"full-backing-filename"`
	BackingFormat   string `json:"backing-filename-format"`
}

// Inspect reads the qcow2 disk at path with qemu-img info; it may be in
// use by a running VM.
func Inspect(ctx context.Context, qemuImg, path string) (Info, error) {
	out, err := output(ctx, nil, qemuImg, "info", "--output", "json", "-U", "-f", "qcow2", path)
	if err != nil {
		return Info{}, fmt.Errorf("inspect workspace disk: %w", err)
	}
	var i Info
	if err := json.Unmarshal(out, &i); err != nil {
		return Info{}, fmt.Errorf("inspect workspace disk %s: %w", path, err)
	}
	return i, nil
}

func run(ctx context.Context, env []string, argv ...string) error {
	_, err := output(ctx, env, argv...)
	return err
}

func output(ctx context.Context, env []string, argv ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		var ee *exec.Error
		if errors.As(err, &ee) {
			return nil, fmt.Errorf("%s: %w", argv[0], err)
		}
		return nil, fmt.Errorf("%s: %w: %s", strings.Join(argv, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.Bytes(), nil
}
