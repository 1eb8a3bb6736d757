package store

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/carrel-os/carrel/image/imagedir"
	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/image/sysroot"
)

// writeImageDir writes a valid image directory (image/imagedir) with a
// verified root of systemBlocks 4 KiB blocks and returns it with its
// manifest. name makes images differ. The root's content is opaque to the
// store, so it is not an erofs and the test needs no mkfs.erofs.
func writeImageDir(t *testing.T, name string, systemBlocks int) (string, *manifest.Manifest) {
	t.Helper()
	dir := t.TempDir()
	write := func(part string, data []byte) manifest.Part {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, imagedir.FileName(part)), data, 0o644); err != nil {
			t.Fatal(err)
		}
		return manifest.Part{Digest: manifest.DigestBytes(data), Size: int64(len(data))}
	}
	ws := write(manifest.PartWorkspace, []byte("workspace of "+name))
	data := make([]byte, systemBlocks*4096)
	copy(data, name)
	for i := len(name); i < len(data); i++ {
		data[i] = byte(i*13 + i/4096)
	}
	write(manifest.PartSystem, data)
	r, err := sysroot.Seal(filepath.Join(dir, imagedir.FileName(manifest.PartSystem)),
		filepath.Join(dir, imagedir.FileName(manifest.PartSystemVerity)), "")
	if err != nil {
		t.Fatal(err)
	}
	m := &manifest.Manifest{
		SchemaVersion: manifest.SchemaVersion,
		Name:          name,
		Arch:          "amd64",
		KernelVersion: "6.1.0-99-amd64",
		Kernel:        write(manifest.PartKernel, []byte("kernel of "+name)),
		Initrd:        write(manifest.PartInitrd, []byte("initrd of "+name)),
		Cmdline:       "console=ttyS0 " + r.Cmdline,
		Workspace:     &ws,
		System:        &r.System,
		SystemVerity:  &r.SystemVerity,
		Verity:        &r.Verity,
	}
	writeDirManifest(t, dir, m)
	return dir, m
}

func writeDirManifest(t *testing.T, dir string, m *manifest.Manifest) {
	t.Helper()
	b, err := m.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, imagedir.ManifestFile), b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// snapshot records every path under the store with its mode and, for a
// file, its size and mtime, to show that a failed import changed nothing.
// Directories' mtimes are left out: temp files come and go in tmp/.
func snapshot(t *testing.T, s *Store) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.Walk(s.Dir(), func(p string, fi fs.FileInfo, err error) error {
		if err != nil {
			return err
		}
		out[p] = fi.Mode().String()
		if !fi.IsDir() {
			out[p] += fmt.Sprintf(" %d bytes, modified %s", fi.Size(), fi.ModTime())
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// sameSnapshot reports every path that differs between two snapshots.
func sameSnapshot(t *testing.T, before, after map[string]string) {
	t.Helper()
	for p, a := range after {
		if b, ok := before[p]; !ok {
			t.Errorf("%s appeared: %s", p, a)
		} else if a != b {
			t.Errorf("%s changed: %s, was %s", p, a, b)
		}
	}
	for p := range before {
		if _, ok := after[p]; !ok {
			t.Errorf("%s disappeared", p)
		}
	}
}

func tmpFiles(t *testing.T, s *Store) []string {
	t.Helper()
	des, err := os.ReadDir(filepath.Join(s.Dir(), tmpDir))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, de := range des {
		names = append(names, de.Name())
	}
	return names
}

func TestImport(t *testing.T) {
	s := open(t)
	dir, m := writeImageDir(t, "test-image", 8)
	want, err := m.Digest()
	if err != nil {
		t.Fatal(err)
	}
	imp, err := s.Import(dir, "dev")
	if err != nil {
		t.Fatal(err)
	}
	if imp.Digest != want || imp.Already || !reflect.DeepEqual(imp.Manifest, m) {
		t.Errorf("Import = %+v, want digest %s, not Already", imp, want)
	}
	r, err := s.Verify("dev")
	if err != nil {
		t.Fatal(err)
	}
	if r.Digest != want || r.SystemPath == "" || r.SystemVerityPath == "" || r.WorkspacePath == "" {
		t.Fatalf("Resolve = %+v", r)
	}
	for _, p := range []struct {
		path string
		part manifest.Part
	}{
		{r.KernelPath, m.Kernel}, {r.InitrdPath, m.Initrd}, {r.WorkspacePath, *m.Workspace},
		{r.SystemPath, *m.System}, {r.SystemVerityPath, *m.SystemVerity},
	} {
		fi, err := os.Lstat(p.path)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode() != 0o444 || fi.Size() != p.part.Size || p.path != s.blobPath(p.part.Digest) {
			t.Errorf("blob %s: mode %v, %d bytes; want read-only, %d bytes", p.path, fi.Mode(), fi.Size(), p.part.Size)
		}
	}
	if err := imagedir.VerifySystem(r.Manifest, r.SystemPath, r.SystemVerityPath); err != nil {
		t.Errorf("stored root: %v", err)
	}
	if names := tmpFiles(t, s); len(names) != 0 {
		t.Errorf("tmp holds %v", names)
	}

	// Again: nothing is written, not even the manifest's mtime, which List
	// reports as when the image was stored.
	old := time.Date(2020, 1, 2, 3, 4, 5, 0, time.UTC)
	if err := os.Chtimes(s.manifestPath(want), old, old); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, s)
	imp, err = s.Import(dir, "dev")
	if err != nil || !imp.Already || imp.Digest != want {
		t.Fatalf("second Import = %+v, %v; want Already", imp, err)
	}
	sameSnapshot(t, before, snapshot(t, s))
	if l, err := s.List(); err != nil || len(l) != 1 || !l[0].Created.Equal(old) {
		t.Errorf("List = %+v, %v", l, err)
	}

	// A new tag for a stored image is not Already, and keeps the old tag.
	imp, err = s.Import(dir, "other")
	if err != nil || imp.Already {
		t.Fatalf("Import under a second tag = %+v, %v", imp, err)
	}
	if l, _ := s.List(); len(l) != 1 || !reflect.DeepEqual(l[0].Tags, []string{"dev", "other"}) || !l[0].Created.Equal(old) {
		t.Errorf("List = %+v", l)
	}
	// Without a tag, a stored image is Already.
	if imp, err := s.Import(dir, ""); err != nil || !imp.Already {
		t.Errorf("untagged Import = %+v, %v", imp, err)
	}
}

// TestImportFailsCleanly imports bad image directories into a store that
// already holds an image: each must fail and leave the store as it was.
func TestImportFailsCleanly(t *testing.T) {
	cases := []struct {
		name   string
		breaks func(t *testing.T, dir string, m *manifest.Manifest)
		tag    string
		want   error
		says   string
	}{
		{
			name: "digest mismatch",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) {
				flipByte(t, filepath.Join(dir, imagedir.FileName(manifest.PartInitrd)), 2)
			},
			want: imagedir.ErrInvalid, says: "hashes to",
		},
		{
			name: "system digest mismatch",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) {
				flipByte(t, filepath.Join(dir, imagedir.FileName(manifest.PartSystem)), 3*4096)
			},
			want: imagedir.ErrInvalid, says: "hashes to",
		},
		{
			name: "verity root hash mismatch",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) {
				old, other := m.Verity.RootHash, strings.Repeat("5a", 32)
				m.Verity.RootHash = other
				m.Cmdline = strings.Replace(m.Cmdline, "roothash="+old, "roothash="+other, 1)
				writeDirManifest(t, dir, m)
			},
			want: imagedir.ErrInvalid, says: "verity",
		},
		{
			name: "system changed, digest recomputed",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) {
				p := filepath.Join(dir, imagedir.FileName(manifest.PartSystem))
				flipByte(t, p, 5*4096+17)
				b, err := os.ReadFile(p)
				if err != nil {
					t.Fatal(err)
				}
				m.System.Digest = manifest.DigestBytes(b)
				writeDirManifest(t, dir, m)
			},
			want: imagedir.ErrInvalid, says: "verity",
		},
		{
			name: "missing part",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) {
				os.Remove(filepath.Join(dir, imagedir.FileName(manifest.PartSystemVerity)))
			},
			want: imagedir.ErrInvalid, says: "missing",
		},
		{
			name:   "bad tag",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) {},
			tag:    "Bad Tag",
			want:   ErrInvalidRef,
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := open(t)
			held, _ := writeImageDir(t, "held", 4)
			if _, err := s.Import(held, "held"); err != nil {
				t.Fatal(err)
			}
			list, err := s.List()
			if err != nil {
				t.Fatal(err)
			}
			before := snapshot(t, s)

			dir, m := writeImageDir(t, "bad", 8)
			c.breaks(t, dir, m)
			tag := c.tag
			if tag == "" {
				tag = "bad"
			}
			_, err = s.Import(dir, tag)
			if !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.says) {
				t.Fatalf("Import = %v, want an error wrapping %v that says %q", err, c.want, c.says)
			}
			t.Log(err)
			if names := tmpFiles(t, s); len(names) != 0 {
				t.Errorf("tmp holds %v", names)
			}
			sameSnapshot(t, before, snapshot(t, s))
			if l, err := s.List(); err != nil || !reflect.DeepEqual(l, list) {
				t.Errorf("List = %+v, %v; want %+v", l, err, list)
			}
			if _, err := s.Resolve("bad"); !errors.Is(err, ErrNotFound) {
				t.Errorf("Resolve(bad) = %v, want ErrNotFound", err)
			}
		})
	}
}

func flipByte(t *testing.T, path string, off int) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	b[off] ^= 1
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// mountTmpfs mounts a tmpfs of size bytes at a new directory, for as long
// as the test runs; it skips the test where it cannot (not root, no mount
// namespace rights).
func mountTmpfs(t *testing.T, size string) string {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("not root: cannot mount a small tmpfs to fill")
	}
	dir := t.TempDir()
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size="+size); err != nil {
		t.Skipf("mount a %s tmpfs: %v", size, err)
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(dir, 0); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	})
	return dir
}

// TestImportDiskFull imports an image larger than the store's file
// system: the copy fails, and nothing of it stays.
func TestImportDiskFull(t *testing.T) {
	s, err := Open(mountTmpfs(t, "2m"))
	if err != nil {
		t.Fatal(err)
	}
	dir, _ := writeImageDir(t, "big", 768) // 3 MiB of root file system
	_, err = s.Import(dir, "big")
	if !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("Import = %v, want an error wrapping ENOSPC", err)
	}
	t.Log(err)
	for _, d := range []string{tmpDir, blobDir, manifestDir, tagDir} {
		des, err := os.ReadDir(filepath.Join(s.Dir(), d))
		if err != nil {
			t.Fatal(err)
		}
		if len(des) != 0 {
			t.Errorf("%s holds %d files after a failed import", d, len(des))
		}
	}
	if l, err := s.List(); err != nil || len(l) != 0 {
		t.Errorf("List = %+v, %v", l, err)
	}
}

// TestImportDiskFullAtCommit fills the store's file system so that the
// parts can be staged but not the manifest, or not the tag: the import
// must still fail before it commits anything. With two pages more than the
// parts need, it succeeds, which shows the page counting is right.
func TestImportDiskFullAtCommit(t *testing.T) {
	for spare := range 3 {
		t.Run(fmt.Sprintf("%d spare pages", spare), func(t *testing.T) {
			dir := mountTmpfs(t, "1m")
			s, err := Open(dir)
			if err != nil {
				t.Fatal(err)
			}
			img, m := writeImageDir(t, "tight", 16)
			var need int64
			for _, p := range m.Parts() {
				need += (p.Part.Size + 4095) / 4096
			}
			var st syscall.Statfs_t
			if err := syscall.Statfs(dir, &st); err != nil {
				t.Fatal(err)
			}
			if st.Bsize != 4096 {
				t.Skipf("tmpfs block size %d", st.Bsize)
			}
			// Outside the store's directories, so List and the checks
			// below do not see it.
			fill := (int64(st.Bavail) - need - int64(spare)) * 4096
			if err := os.WriteFile(filepath.Join(dir, "filler"), make([]byte, fill), 0o644); err != nil {
				t.Fatal(err)
			}
			_, err = s.Import(img, "tight")
			if spare == 2 {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatalf("Import = %v, want an error wrapping ENOSPC", err)
			}
			t.Log(err)
			for _, d := range []string{tmpDir, blobDir, manifestDir, tagDir} {
				if des, _ := os.ReadDir(filepath.Join(s.Dir(), d)); len(des) != 0 {
					t.Errorf("%s holds %d files after a failed import", d, len(des))
				}
			}
		})
	}
}
