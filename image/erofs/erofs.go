// Package erofs makes the read-only root file system of an image with
// mkfs.erofs (erofs-utils), reproducibly: one timestamp for every file,
// a fixed file system UUID, and the result padded to whole blocks, so that
// the same tree always gives the same bytes and dm-verity can cover them.
package erofs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
)

// BlockSize is the erofs block size, and the dm-verity data block size of
// every image carrel builds.
const BlockSize = 4096

// Options configures Make.
type Options struct {
	// Compressor is "" (none: fastest to read under TCG) or one of
	// mkfs.erofs's, e.g. "lz4hc" (smaller, for large userlands).
	Compressor string
	// Epoch is the timestamp given to every file (SOURCE_DATE_EPOCH).
	Epoch int64
	// UUID is the file system's UUID; empty means a fixed one.
	UUID string
	// AllRoot makes root the owner of every file, whoever owns it in the
	// tree: for a tree laid out by an unprivileged build (the Nix store's
	// paths, copied in a derivation).
	AllRoot bool
	// MkfsErofs is the mkfs.erofs to run; "" means the one on PATH.
	MkfsErofs string
}

// fixedUUID is the UUID of a file system built without Options.UUID.
const fixedUUID = "6361726c-726f-4f00-8000-000000000001"

// Make writes an erofs image of the tree at dir to out, replacing it. File
// owners, modes and extended attributes are kept from the tree; the caller
// lays it out as the guest must see it.
func Make(ctx context.Context, dir, out string, o Options) error {
	mkfs := o.MkfsErofs
	if mkfs == "" {
		mkfs = "mkfs.erofs"
	}
	uuid := o.UUID
	if uuid == "" {
		uuid = fixedUUID
	}
	args := []string{"--quiet", "-T" + strconv.FormatInt(o.Epoch, 10), "-U" + uuid}
	if o.Compressor != "" {
		args = append(args, "-z"+o.Compressor)
	}
	if o.AllRoot {
		args = append(args, "--all-root")
	}
	args = append(args, out, dir)
	os.Remove(out)
	cmd := exec.CommandContext(ctx, mkfs, args...)
	cmd.Env = append(os.Environ(), "SOURCE_DATE_EPOCH="+strconv.FormatInt(o.Epoch, 10), "LC_ALL=C")
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stderr, &stderr
	if err := cmd.Run(); err != nil {
		os.Remove(out)
		var ee *exec.Error
		if errors.As(err, &ee) {
			return fmt.Errorf("make erofs: %w (install erofs-utils)", err)
		}
		return fmt.Errorf("make erofs: %s %s: %w: %s", mkfs, strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	if err := padToBlock(out); err != nil {
		os.Remove(out)
		return fmt.Errorf("make erofs: %w", err)
	}
	return nil
}

// padToBlock extends the image with zeros to a whole number of blocks, as
// dm-verity covers whole blocks; erofs ignores what lies past its end.
func padToBlock(path string) error {
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	if fi.Size()%BlockSize == 0 {
		return nil
	}
	return os.Truncate(path, (fi.Size()/BlockSize+1)*BlockSize)
}
