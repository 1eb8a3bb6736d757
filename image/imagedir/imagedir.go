// Package imagedir reads an image directory: carrel's image format on disk,
// as every builder writes it (the Debian builder, the dev image, the NixOS
// flake's agent-image) and as `carrel image import` and `carrel image check`
// take it. The directory holds manifest.json and one file per part the
// manifest names, under the part's fixed file name (FileName), and nothing
// else. docs/image-format.md describes it.
//
// Read checks the layout cheaply (names, file types, sizes); Check also
// hashes every part and recomputes the dm-verity tree. A directory is
// untrusted input: nothing in it is followed out of it, and no size is
// believed before it is bounded.
package imagedir

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"syscall"

	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/image/verity"
)

// ManifestFile is the manifest's name in an image directory.
const ManifestFile = "manifest.json"

// ErrInvalid wraps every reason a directory is not a valid image.
var ErrInvalid = errors.New("not a valid carrel image directory")

var fileNames = map[string]string{
	manifest.PartKernel:       "vmlinuz",
	manifest.PartInitrd:       "initrd.img",
	manifest.PartWorkspace:    "workspace.img",
	manifest.PartSystem:       "system.erofs",
	manifest.PartSystemVerity: "system.verity",
}

// OpenPart opens a part's file for reading, refusing a symbolic link that
// replaced it after Read looked: what is read is then hashed against the
// manifest anyway.
func OpenPart(path string) (*os.File, error) {
	// O_NONBLOCK: a named pipe swapped in must not hang the open.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err == nil && !fi.Mode().IsRegular() {
		err = fmt.Errorf("%s is a %s, not a regular file", path, kind(fi.Mode()))
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// FileName is the file that holds part (a manifest.Part* name).
func FileName(part string) string { return fileNames[part] }

// File is one part of an image directory.
type File struct {
	Name string // the part's name (manifest.Part*)
	Path string
	Part manifest.Part
}

// Dir is an image directory whose layout Read has checked.
type Dir struct {
	Path     string
	Manifest *manifest.Manifest
	// Digest is the manifest's digest: the image's identity.
	Digest string
	Files  []File
}

// File returns the file of part name; ok is false if the image has none.
func (d *Dir) File(name string) (File, bool) {
	i := slices.IndexFunc(d.Files, func(f File) bool { return f.Name == name })
	if i < 0 {
		return File{}, false
	}
	return d.Files[i], true
}

// Read checks dir's layout: a valid manifest, exactly the files it names
// (no others, no links, no subdirectories), each of the size it states.
// dir itself may be a symbolic link (a nix build's ./result). Nothing is
// hashed.
func Read(dir string) (*Dir, error) {
	path, err := filepath.EvalSymlinks(dir)
	if errors.Is(err, fs.ErrNotExist) {
		if fi, lerr := os.Lstat(dir); lerr == nil && fi.Mode()&fs.ModeSymlink != 0 {
			target, _ := os.Readlink(dir)
			return nil, fmt.Errorf("%w: %s is a link to %s, which is gone (an old build result, since garbage-collected? build it again)", ErrInvalid, dir, target)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if fi, err := os.Stat(path); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	} else if !fi.IsDir() {
		return nil, fmt.Errorf("%w: %s is not a directory", ErrInvalid, dir)
	}
	b, err := readRegular(filepath.Join(path, ManifestFile), manifest.MaxSize)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w: %s has no %s: not an image directory, or a build that did not finish (the manifest is written last)", ErrInvalid, dir, ManifestFile)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrInvalid, ManifestFile, err)
	}
	m, err := manifest.Parse(b)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrInvalid, ManifestFile, err)
	}
	canon, err := m.Marshal()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	d := &Dir{Path: path, Manifest: m, Digest: manifest.DigestBytes(canon)}
	want := map[string]bool{ManifestFile: true}
	for _, np := range m.Parts() {
		name := fileNames[np.Name]
		want[name] = true
		p := filepath.Join(path, name)
		fi, err := os.Lstat(p)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			return nil, fmt.Errorf("%w: the manifest names a %s, but %s is missing", ErrInvalid, np.Name, name)
		case err != nil:
			return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
		case !fi.Mode().IsRegular():
			return nil, fmt.Errorf("%w: %s is a %s, not a regular file", ErrInvalid, name, kind(fi.Mode()))
		case fi.Size() != np.Part.Size:
			return nil, fmt.Errorf("%w: %s is %d bytes, the manifest says %d", ErrInvalid, name, fi.Size(), np.Part.Size)
		}
		d.Files = append(d.Files, File{Name: np.Name, Path: p, Part: np.Part})
	}
	ents, err := os.ReadDir(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	for _, e := range ents {
		if !want[e.Name()] {
			return nil, fmt.Errorf("%w: %q is not part of the image (the manifest names %d parts)", ErrInvalid, e.Name(), len(d.Files))
		}
	}
	return d, nil
}

// Check reads dir, then hashes every part against the manifest and, for an
// image with a verified root, recomputes the dm-verity tree and root hash
// from the root file system and compares them with the hash device and the
// manifest.
func Check(dir string) (*Dir, error) {
	d, err := Read(dir)
	if err != nil {
		return nil, err
	}
	for _, f := range d.Files {
		got, err := hashFile(f.Path, f.Part.Size)
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
		}
		if got != f.Part.Digest {
			return nil, fmt.Errorf("%w: %s hashes to %s, the manifest says %s", ErrInvalid, filepath.Base(f.Path), got, f.Part.Digest)
		}
	}
	sys, _ := d.File(manifest.PartSystem)
	hash, _ := d.File(manifest.PartSystemVerity)
	if err := VerifySystem(d.Manifest, sys.Path, hash.Path); err != nil {
		return nil, err
	}
	return d, nil
}

// VerifySystem recomputes m's dm-verity tree from the root file system at
// system and checks the hash device at hash and the manifest's root hash
// against it. It does nothing for an image without a verified root.
func VerifySystem(m *manifest.Manifest, system, hash string) error {
	if m.Verity == nil {
		return nil
	}
	p, root, err := m.Verity.Params()
	if err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	df, err := os.Open(system)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	defer df.Close()
	hf, err := os.Open(hash)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	defer hf.Close()
	if err := verity.Verify(df, m.System.Size, hf, m.SystemVerity.Size, p, root); err != nil {
		return fmt.Errorf("%w: verity: %w", ErrInvalid, err)
	}
	return nil
}

// HashFile returns the digest of the regular file at path, which must be
// size bytes long.
func hashFile(path string, size int64) (string, error) {
	f, err := OpenPart(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, io.LimitReader(f, size+1))
	if err != nil {
		return "", fmt.Errorf("hash %s: %w", path, err)
	}
	if n != size {
		return "", fmt.Errorf("%s changed size while it was read (%d bytes, want %d)", path, n, size)
	}
	return manifest.DigestPrefix + hex.EncodeToString(h.Sum(nil)), nil
}

// readRegular reads the regular file at path, refusing links, other file
// types and anything over limit bytes.
func readRegular(path string, limit int64) ([]byte, error) {
	fi, err := os.Lstat(path)
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("a %s, not a regular file", kind(fi.Mode()))
	}
	if fi.Size() > limit {
		return nil, fmt.Errorf("%d bytes, limit %d", fi.Size(), limit)
	}
	f, err := OpenPart(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("more than %d bytes", limit)
	}
	return b, nil
}

func kind(m fs.FileMode) string {
	switch {
	case m&fs.ModeSymlink != 0:
		return "symbolic link"
	case m.IsDir():
		return "directory"
	case m&fs.ModeDevice != 0:
		return "device"
	case m&fs.ModeNamedPipe != 0:
		return "named pipe"
	case m&fs.ModeSocket != 0:
		return "socket"
	}
	return "special file"
}
