// Package sysroot turns a directory tree into an image's verified root:
// a reproducible erofs file system (image/erofs), its dm-verity hash device
// (image/verity) with a salt and UUID derived from the file system's
// content, the manifest's Verity record, and the kernel command-line words
// that name the root hash and the two disks the way systemd does.
// Every builder (the dev image, the Debian builder, the NixOS flake's pack
// step) goes through Make, so the format has one implementation.
package sysroot

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/image/erofs"
	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/image/verity"
)

// Options configures Make.
type Options struct {
	// Erofs are the file system's options (compression, timestamp).
	Erofs erofs.Options
	// Mount is manifest.MountRoot (the default) or manifest.MountUsr.
	Mount string
}

// Result is a verified root as the manifest records it.
type Result struct {
	System, SystemVerity manifest.Part
	Verity               manifest.Verity
	// Cmdline holds the words the kernel command line needs for it.
	Cmdline string
}

// Make builds the erofs image of tree at systemPath and its hash device
// at verityPath.
func Make(ctx context.Context, tree, systemPath, verityPath string, o Options) (*Result, error) {
	if err := erofs.Make(ctx, tree, systemPath, o.Erofs); err != nil {
		return nil, err
	}
	return Seal(systemPath, verityPath, o.Mount)
}

// Seal writes the dm-verity hash device of the file system image at
// systemPath (a whole number of 4 KiB blocks) to verityPath. The salt is
// the file system's own digest and the superblock UUID is derived from it,
// so the same file system always gives the same hash device and root hash.
func Seal(systemPath, verityPath, mount string) (*Result, error) {
	if mount == "" {
		mount = manifest.MountRoot
	}
	if mount != manifest.MountRoot && mount != manifest.MountUsr {
		return nil, fmt.Errorf("seal %s: mount %q: want %q or %q", systemPath, mount, manifest.MountRoot, manifest.MountUsr)
	}
	f, err := os.Open(systemPath)
	if err != nil {
		return nil, fmt.Errorf("seal: %w", err)
	}
	defer f.Close()
	h := sha256.New()
	size, err := io.Copy(h, f)
	if err != nil {
		return nil, fmt.Errorf("seal %s: %w", systemPath, err)
	}
	if size == 0 || size%erofs.BlockSize != 0 {
		return nil, fmt.Errorf("seal %s: %d bytes is not a whole number of %d-byte blocks", systemPath, size, erofs.BlockSize)
	}
	sum := h.Sum(nil)
	system := manifest.Part{Digest: manifest.DigestPrefix + hex.EncodeToString(sum), Size: size}
	uuidSum := sha256.Sum256(append([]byte("carrel verity uuid\x00"), sum...))
	var uuid [16]byte
	copy(uuid[:], uuidSum[:16])
	uuid[6] = uuid[6]&0x0f | 0x80 // RFC 9562 version 8 (custom), variant 10
	uuid[8] = uuid[8]&0x3f | 0x80
	p := verity.Params{
		HashAlg:       "sha256",
		DataBlockSize: erofs.BlockSize,
		HashBlockSize: erofs.BlockSize,
		DataBlocks:    uint64(size / erofs.BlockSize),
		Salt:          sum,
		UUID:          uuid,
	}
	root, hashPart, err := writeHash(f, size, p, verityPath)
	if err != nil {
		return nil, fmt.Errorf("seal %s: %w", systemPath, err)
	}
	v := manifest.Verity{
		Mount:         mount,
		RootHash:      hex.EncodeToString(root),
		HashAlg:       p.HashAlg,
		DataBlockSize: p.DataBlockSize,
		HashBlockSize: p.HashBlockSize,
		DataBlocks:    p.DataBlocks,
		Salt:          hex.EncodeToString(p.Salt),
		UUID:          manifest.FormatUUID(uuid),
	}
	return &Result{System: system, SystemVerity: hashPart, Verity: v, Cmdline: CmdlineWords(v)}, nil
}

func writeHash(data io.ReaderAt, size int64, p verity.Params, path string) (root []byte, part manifest.Part, err error) {
	out, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return nil, manifest.Part{}, err
	}
	defer func() {
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			os.Remove(path)
		}
	}()
	h := sha256.New()
	bw := bufio.NewWriterSize(io.MultiWriter(out, h), 1<<20)
	root, err = verity.Format(data, size, p, bw)
	if err != nil {
		return nil, manifest.Part{}, err
	}
	if err := bw.Flush(); err != nil {
		return nil, manifest.Part{}, err
	}
	if err := out.Sync(); err != nil {
		return nil, manifest.Part{}, err
	}
	part = manifest.Part{Digest: manifest.DigestPrefix + hex.EncodeToString(h.Sum(nil)), Size: verity.HashSize(p)}
	return root, part, nil
}

// CmdlineWords are the kernel command-line words for v, in systemd's names:
// the root hash (roothash= or usrhash=) and the data and hash devices by
// their udev names, which carrel-agent maps back to disk serials.
func CmdlineWords(v manifest.Verity) string {
	which := v.Mount
	return strings.Join([]string{
		manifest.HashParam(v.Mount) + "=" + v.RootHash,
		"systemd.verity_" + which + "_data=" + protocol.DiskByIDPrefix + protocol.SystemSerial,
		"systemd.verity_" + which + "_hash=" + protocol.DiskByIDPrefix + protocol.SystemVeritySerial,
	}, " ")
}
