//go:build linux

package initsys

import (
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/guest-agent/dm"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/image/verity"
)

// ErrRoot means the verified root could not be set up: a disk is missing,
// the hash device is malformed, or the root file system does not match its
// root hash. The agent does not serve then: the boot fails with the reason
// on the console.
var ErrRoot = errors.New("verified root")

// Where the root is put together in the initramfs, and where its parts
// are found once it is the root.
const (
	sysroot   = "/sysroot"
	lowerDir  = "/.carrel-lower" // the erofs, read-only
	stateDir  = "/.carrel-state" // the writable layer's file system
	runCarrel = "/run/carrel"    // lower and state, after the switch
	// dmName is the device-mapper name of the verified root.
	dmName = "carrel-root"
)

// Root is a verified root as the kernel command line describes it.
type Root struct {
	// Hash is the dm-verity root hash (roothash=).
	Hash []byte
	// DataSerial and HashSerial are the serials of the disks that hold
	// the root file system and its hash device.
	DataSerial, HashSerial string
	// State is where the writable layer lives: protocol.StateDisk or
	// protocol.StateMemory.
	State string
	// Init, when set (init=), is executed once the root is switched to,
	// in place of serving: an image whose init is systemd, say, which
	// starts carrel-agent as a service.
	Init string
}

// ParseRoot reads the verified root from a kernel command line, in
// systemd's names: roothash=, systemd.verity_root_data= and
// systemd.verity_root_hash= (as /dev/disk/by-id/virtio-SERIAL), plus
// carrel.state= (required) and init=. ok is false when the line has no
// roothash=: the initramfs is the root. usrhash= (a verified /usr) is for a systemd
// initrd to set up, and an error here.
func ParseRoot(cmdline string) (r Root, ok bool, err error) {
	seen := map[string]bool{}
	for _, f := range strings.Fields(cmdline) {
		k, v, _ := strings.Cut(f, "=")
		switch k {
		case "roothash", "systemd.verity_root_data", "systemd.verity_root_hash", protocol.StateArg, "init", "usrhash":
		default:
			continue
		}
		if seen[k] {
			return Root{}, false, fmt.Errorf("%w: %s= is given twice", ErrRoot, k)
		}
		seen[k] = true
		switch k {
		case "roothash":
			if len(v) != 64 || strings.ToLower(v) != v {
				return Root{}, false, fmt.Errorf("%w: roothash=%q: want 64 lower-case hex digits", ErrRoot, v)
			}
			h, err := hex.DecodeString(v)
			if err != nil || len(h) != 32 {
				return Root{}, false, fmt.Errorf("%w: roothash=%q: want 64 lower-case hex digits", ErrRoot, v)
			}
			r.Hash = h
		case "systemd.verity_root_data", "systemd.verity_root_hash":
			serial, ok := strings.CutPrefix(v, protocol.DiskByIDPrefix)
			if !ok || serial == "" || len(serial) > 20 || strings.ContainsAny(serial, "/ ") {
				return Root{}, false, fmt.Errorf("%w: %s=%q: want %sSERIAL", ErrRoot, k, v, protocol.DiskByIDPrefix)
			}
			if k == "systemd.verity_root_data" {
				r.DataSerial = serial
			} else {
				r.HashSerial = serial
			}
		case protocol.StateArg:
			if v != protocol.StateDisk && v != protocol.StateMemory {
				return Root{}, false, fmt.Errorf("%w: %s=%q: want %s or %s", ErrRoot, k, v, protocol.StateDisk, protocol.StateMemory)
			}
			r.State = v
		case "init":
			if !filepath.IsAbs(v) || filepath.Clean(v) != v {
				return Root{}, false, fmt.Errorf("%w: init=%q: want a clean absolute path", ErrRoot, v)
			}
			r.Init = v
		case "usrhash":
			return Root{}, false, fmt.Errorf("%w: usrhash= (a verified /usr) needs a systemd initrd, not carrel-agent as the initramfs's init", ErrRoot)
		}
	}
	if r.Hash == nil {
		if seen["systemd.verity_root_data"] || seen["systemd.verity_root_hash"] {
			return Root{}, false, fmt.Errorf("%w: verity devices are named, but there is no roothash=", ErrRoot)
		}
		return Root{}, false, nil
	}
	if r.DataSerial == "" || r.HashSerial == "" {
		return Root{}, false, fmt.Errorf("%w: roothash= needs systemd.verity_root_data= and systemd.verity_root_hash=", ErrRoot)
	}
	if r.State == "" {
		// carreld always says where the VM's changes go; a line without
		// it was cut short, and must not send them to memory unseen.
		return Root{}, false, fmt.Errorf("%w: %s= is missing (a kernel command line cut short?)", ErrRoot, protocol.StateArg)
	}
	return r, true, nil
}

// switchRoot sets up the verified root and makes it the root: dm-verity
// over the system disk, erofs on it read-only, the writable layer (the
// state disk, or memory) over it as an overlay, then the kernel file
// systems moved into it, the initramfs emptied, and a chroot. /dev,
// /proc and /sys must be mounted and the modules loaded.
func switchRoot(log *slog.Logger, r Root) error {
	dataDev, err := diskDevice(r.DataSerial)
	if err != nil {
		return fmt.Errorf("%w: root file system disk: %w", ErrRoot, err)
	}
	hashDev, err := diskDevice(r.HashSerial)
	if err != nil {
		return fmt.Errorf("%w: hash device disk: %w", ErrRoot, err)
	}
	p, err := readSuperblock("/dev/" + hashDev.name)
	if err != nil {
		return fmt.Errorf("%w: hash device /dev/%s: %w", ErrRoot, hashDev.name, err)
	}
	sectors := p.DataBlocks * uint64(p.DataBlockSize) / 512
	if dataDev.sectors < sectors {
		return fmt.Errorf("%w: root file system disk /dev/%s has %d sectors; verity covers %d", ErrRoot, dataDev.name, dataDev.sectors, sectors)
	}
	table := verity.Table(dataDev.majmin, hashDev.majmin, p, r.Hash)
	_, devPath, err := dm.CreateReadOnly(dmName, dm.Target{Start: 0, Length: sectors, Type: "verity", Params: table})
	if err != nil {
		return fmt.Errorf("%w: set up dm-verity: %w", ErrRoot, err)
	}
	for _, d := range []string{lowerDir, stateDir, sysroot} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("%w: %w", ErrRoot, err)
		}
	}
	if err := unix.Mount(devPath, lowerDir, "erofs", unix.MS_RDONLY, ""); err != nil {
		status, _ := dm.Status(dmName)
		if strings.HasPrefix(status, "C") { // dm-verity saw corruption
			return fmt.Errorf("%w: the root file system failed verification against roothash=%x: mount erofs: %w", ErrRoot, r.Hash, err)
		}
		return fmt.Errorf("%w: mount erofs from %s (dm-verity status %q): %w", ErrRoot, devPath, strings.TrimSpace(status), err)
	}
	log.Info("verified root mounted", "device", devPath, "data", dataDev.name, "hash", hashDev.name, "blocks", p.DataBlocks)
	if err := mountState(log, r.State); err != nil {
		return err
	}
	for _, d := range []string{stateDir + "/upper", stateDir + "/work"} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("%w: writable layer: %w", ErrRoot, err)
		}
	}
	opts := "lowerdir=" + lowerDir + ",upperdir=" + stateDir + "/upper,workdir=" + stateDir + "/work"
	if err := unix.Mount("overlay", sysroot, "overlay", 0, opts); err != nil {
		return fmt.Errorf("%w: overlay the writable layer on the root: %w", ErrRoot, err)
	}
	// The parts stay reachable, by root only, under /run/carrel.
	if err := unix.Mount("tmpfs", sysroot+"/run", "tmpfs", nodevNosuid, "mode=0755"); err != nil {
		return fmt.Errorf("%w: mount /run: %w", ErrRoot, err)
	}
	moves := [][2]string{
		{lowerDir, sysroot + runCarrel + "/lower"},
		{stateDir, sysroot + runCarrel + "/state"},
		{"/dev", sysroot + "/dev"},
		{"/proc", sysroot + "/proc"},
		{"/sys", sysroot + "/sys"},
	}
	if err := os.Mkdir(sysroot+runCarrel, 0o700); err != nil {
		return fmt.Errorf("%w: %w", ErrRoot, err)
	}
	for _, mv := range moves {
		if err := os.MkdirAll(mv[1], 0o755); err != nil {
			return fmt.Errorf("%w: %w", ErrRoot, err)
		}
		if err := unix.Mount(mv[0], mv[1], "", unix.MS_MOVE, ""); err != nil {
			return fmt.Errorf("%w: move %s to %s: %w", ErrRoot, mv[0], mv[1], err)
		}
	}
	emptyInitramfs(log)
	if err := os.Chdir(sysroot); err != nil {
		return fmt.Errorf("%w: %w", ErrRoot, err)
	}
	if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
		return fmt.Errorf("%w: move the root to /: %w", ErrRoot, err)
	}
	if err := unix.Chroot("."); err != nil {
		return fmt.Errorf("%w: chroot: %w", ErrRoot, err)
	}
	if err := os.Chdir("/"); err != nil {
		return fmt.Errorf("%w: %w", ErrRoot, err)
	}
	log.Info("switched to the verified root", "state", r.State)
	return nil
}

// mountState mounts the writable layer's file system on stateDir: the
// state disk (ext4, grown to the disk's size), or a tmpfs.
func mountState(log *slog.Logger, state string) error {
	if state == protocol.StateMemory {
		if err := unix.Mount("tmpfs", stateDir, "tmpfs", nodevNosuid, "mode=0755"); err != nil {
			return fmt.Errorf("%w: writable layer in memory: %w", ErrRoot, err)
		}
		log.Info("writable layer in memory: the VM's changes end with it")
		return nil
	}
	if err := mountExt4Disk(log, protocol.StateSerial, stateDir); err != nil {
		return fmt.Errorf("%w: writable layer on the state disk: %w", ErrRoot, err)
	}
	return nil
}

// blockDev is a disk as sysfs shows it.
type blockDev struct {
	name    string // vda
	majmin  string // 253:0
	sectors uint64
}

func diskDevice(serial string) (blockDev, error) {
	name, err := findDisk("/sys/block", serial, diskTimeout)
	if err != nil {
		return blockDev{}, err
	}
	b, err := os.ReadFile(filepath.Join("/sys/block", name, "dev"))
	if err != nil {
		return blockDev{}, err
	}
	d := blockDev{name: name, majmin: strings.TrimSpace(string(b))}
	if d.sectors, err = diskSectors(name); err != nil {
		return blockDev{}, err
	}
	return d, nil
}

// readSuperblock reads the dm-verity superblock at the start of the hash
// device at path.
func readSuperblock(path string) (verity.Params, error) {
	f, err := os.Open(path)
	if err != nil {
		return verity.Params{}, err
	}
	defer f.Close()
	return verity.ReadSuperblock(f)
}

// emptyInitramfs removes the initramfs's files, which would otherwise
// hold their memory for the VM's life, as switch_root does. It stays on
// the initramfs's own file system: nothing mounted below it is touched.
func emptyInitramfs(log *slog.Logger) {
	var root unix.Stat_t
	if err := unix.Lstat("/", &root); err != nil {
		log.Warn("initramfs left in memory", "err", err)
		return
	}
	ents, err := os.ReadDir("/")
	if err != nil {
		log.Warn("initramfs left in memory", "err", err)
		return
	}
	for _, e := range ents {
		removeSameDev(filepath.Join("/", e.Name()), root.Dev)
	}
}

func removeSameDev(p string, dev uint64) {
	var st unix.Stat_t
	if unix.Lstat(p, &st) != nil || st.Dev != dev {
		return // a mount point (sysroot, or one moved into it): not ours
	}
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		ents, _ := os.ReadDir(p)
		for _, e := range ents {
			removeSameDev(filepath.Join(p, e.Name()), dev)
		}
		_ = unix.Rmdir(p)
		return
	}
	_ = unix.Unlink(p)
}
