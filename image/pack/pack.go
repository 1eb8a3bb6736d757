// Package pack writes carrel's image directory (image/imagedir) from parts
// that a builder has made: a kernel, an initramfs, the system file system
// (an erofs image, or a tree to make one of) and the command line the
// image boots with. It seals the system under dm-verity (image/sysroot),
// adds the workspace template, and writes the manifest last, so that a
// directory with a manifest is a whole image.
//
// Every builder ends here: the development image and the Debian builder
// in Go, and the NixOS flake through `carrel image pack`, which its
// derivation runs. The image format therefore has one implementation.
package pack

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/carrel-os/carrel/image/erofs"
	"github.com/carrel-os/carrel/image/imagedir"
	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/image/sysroot"
	"github.com/carrel-os/carrel/image/workspace"
	"github.com/carrel-os/carrel/supervisor/atomicfile"
)

// Arch is the architecture of the images carrel builds.
const Arch = "amd64"

// Parts are what an image is made of.
type Parts struct {
	// Name is the image's name (manifest.ValidName); carreld tags it so.
	Name string
	// KernelVersion is the kernel's release (uname -r).
	KernelVersion string
	// Kernel and Initrd are the files of the kernel (bzImage) and the
	// initramfs.
	Kernel, Initrd string
	// System is the file system that dm-verity covers: an erofs image
	// (whole 4 KiB blocks), or a directory, which is made into one with
	// Erofs's options.
	System string
	Erofs  erofs.Options
	// Mount says what System is in the guest: manifest.MountRoot (the
	// default) or manifest.MountUsr.
	Mount string
	// Cmdline is the image's own kernel command line; Pack adds the words
	// that name the root hash and the disks, which Cmdline must not have.
	Cmdline string
	// Packages are the image's packages, in any order.
	Packages []manifest.Package
	// NoWorkspace leaves out the workspace template; VMs of the image then
	// keep /workspace in memory, and their writable layer on carreld's
	// own disk template.
	NoWorkspace bool
}

// verityWords are command-line words that Pack writes from the sealed
// system, and that the caller's Cmdline must therefore not carry.
var verityWords = []string{"roothash", "usrhash", "systemd.verity_root_data", "systemd.verity_root_hash",
	"systemd.verity_usr_data", "systemd.verity_usr_hash", "systemd.verity_root_options", "systemd.verity_usr_options"}

func (p *Parts) validate() error {
	if !manifest.ValidName(p.Name) {
		return fmt.Errorf("image name %q: want [a-z0-9][a-z0-9._-]{0,62}", p.Name)
	}
	if p.KernelVersion == "" {
		return errors.New("the kernel version is required")
	}
	if p.Kernel == "" || p.Initrd == "" || p.System == "" {
		return errors.New("the kernel, the initrd and the system file system are required")
	}
	for _, f := range strings.Fields(p.Cmdline) {
		k, _, _ := strings.Cut(f, "=")
		for _, w := range verityWords {
			if k == w {
				return fmt.Errorf("the command line already has %s=: pack writes the verity words from the system it seals", k)
			}
		}
	}
	return nil
}

// Pack writes the image directory of p to out, creating it. Files of an
// image already there are replaced; its manifest is removed first and
// written last, so an interrupted pack leaves no manifest and is refused
// by every reader.
func Pack(ctx context.Context, out string, p Parts) (*manifest.Manifest, error) {
	if err := p.validate(); err != nil {
		return nil, fmt.Errorf("pack: %w", err)
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return nil, fmt.Errorf("pack: %w", err)
	}
	manifestPath := filepath.Join(out, imagedir.ManifestFile)
	if err := os.Remove(manifestPath); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("pack: %w", err)
	}
	file := func(part string) string { return filepath.Join(out, imagedir.FileName(part)) }
	kernel, err := copyFile(p.Kernel, file(manifest.PartKernel))
	if err != nil {
		return nil, fmt.Errorf("pack: kernel: %w", err)
	}
	initrd, err := copyFile(p.Initrd, file(manifest.PartInitrd))
	if err != nil {
		return nil, fmt.Errorf("pack: initrd: %w", err)
	}
	sys, err := seal(ctx, p, file(manifest.PartSystem), file(manifest.PartSystemVerity))
	if err != nil {
		return nil, fmt.Errorf("pack: system: %w", err)
	}
	m := &manifest.Manifest{
		SchemaVersion: manifest.SchemaVersion,
		Name:          p.Name,
		Arch:          Arch,
		KernelVersion: p.KernelVersion,
		Kernel:        kernel,
		Initrd:        initrd,
		Cmdline:       strings.Join(append(strings.Fields(p.Cmdline), sys.Cmdline), " "),
		System:        &sys.System,
		SystemVerity:  &sys.SystemVerity,
		Verity:        &sys.Verity,
		Packages:      manifest.SortPackages(p.Packages),
	}
	if p.NoWorkspace {
		os.Remove(file(manifest.PartWorkspace))
	} else {
		ws, err := workspaceTemplate(ctx, file(manifest.PartWorkspace))
		if err != nil {
			return nil, fmt.Errorf("pack: %w", err)
		}
		m.Workspace = &ws
	}
	b, err := m.Marshal()
	if err != nil {
		return nil, fmt.Errorf("pack: %w", err)
	}
	if _, err := WriteAtomic(manifestPath, func(w io.Writer) error {
		_, err := w.Write(b)
		return err
	}); err != nil {
		return nil, fmt.Errorf("pack: write manifest: %w", err)
	}
	return m, nil
}

// seal puts the system file system at systemPath, making it from a tree
// or linking (else copying) an image, and writes its hash device.
func seal(ctx context.Context, p Parts, systemPath, verityPath string) (*sysroot.Result, error) {
	fi, err := os.Stat(p.System)
	if err != nil {
		return nil, err
	}
	tmp := filepath.Join(filepath.Dir(systemPath), "."+filepath.Base(systemPath)+".pack")
	os.Remove(tmp)
	defer os.Remove(tmp)
	switch {
	case fi.IsDir():
		if err := erofs.Make(ctx, p.System, tmp, p.Erofs); err != nil {
			return nil, err
		}
	case fi.Mode().IsRegular():
		// A link costs nothing and the source is not written to; a copy
		// serves where linking is refused (another file system, a file
		// of another owner).
		if err := os.Link(p.System, tmp); err != nil {
			if _, err := copyFile(p.System, tmp); err != nil {
				return nil, err
			}
		}
	default:
		return nil, fmt.Errorf("%s is neither a file system image nor a directory", p.System)
	}
	verityTmp := verityPath + ".pack"
	defer os.Remove(verityTmp)
	res, err := sysroot.Seal(tmp, verityTmp, p.Mount)
	if err != nil {
		return nil, err
	}
	if err := os.Rename(tmp, systemPath); err != nil {
		return nil, err
	}
	if err := os.Rename(verityTmp, verityPath); err != nil {
		return nil, err
	}
	return res, atomicfile.SyncDir(filepath.Dir(systemPath))
}

// workspaceTemplate writes the workspace template (image/workspace) to dst.
func workspaceTemplate(ctx context.Context, dst string) (manifest.Part, error) {
	tmp := filepath.Join(filepath.Dir(dst), "."+filepath.Base(dst)+".mkfs")
	defer os.Remove(tmp)
	if err := workspace.Template(ctx, tmp); err != nil {
		return manifest.Part{}, err
	}
	p, err := copyFile(tmp, dst)
	if err != nil {
		return manifest.Part{}, fmt.Errorf("write workspace template: %w", err)
	}
	return p, nil
}

// copyFile copies src to dst (WriteAtomic) and returns dst as a part.
func copyFile(src, dst string) (manifest.Part, error) {
	f, err := os.Open(src)
	if err != nil {
		return manifest.Part{}, err
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil {
		return manifest.Part{}, err
	} else if !fi.Mode().IsRegular() {
		return manifest.Part{}, fmt.Errorf("%s is not a regular file", src)
	}
	return WriteAtomic(dst, func(w io.Writer) error {
		_, err := io.Copy(w, f)
		return err
	})
}

// WriteAtomic writes dst through a synced temp file in its directory and a
// rename, and returns the digest and size of what was written, which must
// not be nothing.
func WriteAtomic(dst string, fill func(w io.Writer) error) (manifest.Part, error) {
	h := sha256.New()
	var n int64
	err := atomicfile.Write(dst, 0o644, func(w io.Writer) error {
		bw := bufio.NewWriterSize(io.MultiWriter(w, h), 1<<20)
		cw := &countWriter{w: bw}
		err := fill(cw)
		if err == nil {
			err = bw.Flush()
		}
		n = cw.n
		if err == nil && n == 0 {
			err = errors.New("nothing written")
		}
		return err
	})
	if err != nil {
		return manifest.Part{}, err
	}
	return manifest.Part{Digest: manifest.DigestPrefix + hex.EncodeToString(h.Sum(nil)), Size: n}, nil
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}
