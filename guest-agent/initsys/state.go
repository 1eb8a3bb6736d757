//go:build linux

package initsys

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// stateBinds are the directories of the root that live in the writable
// layer's /var when it is on the state disk, where under /var they are
// kept, and their modes.
var stateBinds = []struct {
	dir, inVar string
	mode       os.FileMode
}{
	{"home", "home", 0o755},
	{"root", "roothome", 0o700},
}

// StateOf returns carrel.state= from a kernel command line:
// protocol.StateDisk or protocol.StateMemory. carreld always gives it; a
// line without it was cut short.
func StateOf(cmdline string) (string, error) {
	state := ""
	for _, f := range strings.Fields(cmdline) {
		k, v, _ := strings.Cut(f, "=")
		if k != protocol.StateArg {
			continue
		}
		if state != "" {
			return "", fmt.Errorf("%w: %s= is given twice", ErrRoot, k)
		}
		if v != protocol.StateDisk && v != protocol.StateMemory {
			return "", fmt.Errorf("%w: %s=%q: want %s or %s", ErrRoot, k, v, protocol.StateDisk, protocol.StateMemory)
		}
		state = v
	}
	if state == "" {
		return "", fmt.Errorf("%w: %s= is missing (a kernel command line cut short?)", ErrRoot, protocol.StateArg)
	}
	return state, nil
}

// MountState sets up the VM's writable layer below root for an image
// whose initrd is systemd's (the NixOS guest, nix/modules/guest.nix),
// whose / is a tmpfs and whose system is a verified /usr that systemd
// sets up itself. As carrel.state= says: on the state disk, its ext4 is
// mounted on root/var and grown to the disk's size, and root/home and
// root/root are bound from var/home and var/roothome on it; in memory,
// the tmpfs root is the layer, and nothing is mounted.
func MountState(log *slog.Logger, root string) error {
	cmdline, err := os.ReadFile("/proc/cmdline")
	if err != nil {
		return fmt.Errorf("%w: %w", ErrRoot, err)
	}
	state, err := StateOf(string(cmdline))
	if err != nil {
		return err
	}
	if state == protocol.StateMemory {
		log.Info("writable layer in memory: the VM's changes end with it")
		return nil
	}
	varDir := filepath.Join(root, "var")
	if err := mountExt4Disk(log, protocol.StateSerial, varDir); err != nil {
		return fmt.Errorf("%w: writable layer on the state disk: %w", ErrRoot, err)
	}
	// The disk template's root belongs to the agent's user (it is the
	// workspace's template too); /var is root's.
	if err := os.Chown(varDir, 0, 0); err != nil {
		return fmt.Errorf("%w: %w", ErrRoot, err)
	}
	if err := os.Chmod(varDir, 0o755); err != nil {
		return fmt.Errorf("%w: %w", ErrRoot, err)
	}
	for _, b := range stateBinds {
		src, dst := filepath.Join(varDir, b.inVar), filepath.Join(root, b.dir)
		if err := os.Mkdir(src, b.mode); err != nil && !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("%w: %w", ErrRoot, err)
		}
		if err := os.MkdirAll(dst, b.mode); err != nil {
			return fmt.Errorf("%w: %w", ErrRoot, err)
		}
		if err := unix.Mount(src, dst, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("%w: bind %s on %s: %w", ErrRoot, src, dst, err)
		}
	}
	log.Info("writable layer on the state disk", "var", varDir)
	return nil
}
