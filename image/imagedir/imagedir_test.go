package imagedir

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/image/sysroot"
)

// systemBlocks is the size of the test images' root file system. Its
// content is opaque to this package, so it is not an erofs: Seal needs only
// whole blocks, and the test needs no mkfs.erofs.
const systemBlocks = 40

// writeImage writes a valid image directory under a new temp dir: every
// part, with a verified root when withSystem, and its manifest.
func writeImage(t *testing.T, withSystem bool) (string, *manifest.Manifest) {
	t.Helper()
	dir := t.TempDir()
	write := func(part string, data []byte) manifest.Part {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, FileName(part)), data, 0o644); err != nil {
			t.Fatal(err)
		}
		return manifest.Part{Digest: manifest.DigestBytes(data), Size: int64(len(data))}
	}
	ws := write(manifest.PartWorkspace, []byte("workspace template"))
	m := &manifest.Manifest{
		SchemaVersion: manifest.SchemaVersion,
		Name:          "test-image",
		Arch:          "amd64",
		KernelVersion: "6.1.0-99-amd64",
		Kernel:        write(manifest.PartKernel, []byte("fake bzImage")),
		Initrd:        write(manifest.PartInitrd, []byte("fake initramfs")),
		Cmdline:       "console=ttyS0 quiet panic=-1",
		Workspace:     &ws,
		Packages:      []manifest.Package{{Name: "busybox-static", Version: "1:1.35.0-4+b3", Arch: "amd64"}},
	}
	if withSystem {
		data := make([]byte, systemBlocks*4096)
		for i := range data {
			data[i] = byte(i*7 + i/4096)
		}
		write(manifest.PartSystem, data)
		r, err := sysroot.Seal(filepath.Join(dir, FileName(manifest.PartSystem)), filepath.Join(dir, FileName(manifest.PartSystemVerity)), "")
		if err != nil {
			t.Fatal(err)
		}
		m.System, m.SystemVerity, m.Verity = &r.System, &r.SystemVerity, &r.Verity
		m.Cmdline += " " + r.Cmdline
	}
	writeManifest(t, dir, m)
	return dir, m
}

func writeManifest(t *testing.T, dir string, m *manifest.Manifest) {
	t.Helper()
	b, err := m.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	writeRaw(t, filepath.Join(dir, ManifestFile), b)
}

// writeRaw replaces the file at p with data, whatever p was.
func writeRaw(t *testing.T, p string, data []byte) {
	t.Helper()
	if err := os.RemoveAll(p); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

func partPath(dir, part string) string { return filepath.Join(dir, FileName(part)) }

// editPart applies f to a part's bytes in place.
func editPart(t *testing.T, dir, part string, f func([]byte) []byte) []byte {
	t.Helper()
	b, err := os.ReadFile(partPath(dir, part))
	if err != nil {
		t.Fatal(err)
	}
	b = f(b)
	writeRaw(t, partPath(dir, part), b)
	return b
}

func flip(off int) func([]byte) []byte {
	return func(b []byte) []byte { b[off] ^= 0x40; return b }
}

func TestReadAndCheckValid(t *testing.T) {
	for _, withSystem := range []bool{true, false} {
		dir, m := writeImage(t, withSystem)
		want, err := m.Digest()
		if err != nil {
			t.Fatal(err)
		}
		for name, f := range map[string]func(string) (*Dir, error){"Read": Read, "Check": Check} {
			d, err := f(dir)
			if err != nil {
				t.Fatalf("system %v: %s: %v", withSystem, name, err)
			}
			if d.Digest != want || d.Path != dir || len(d.Files) != len(m.Parts()) {
				t.Errorf("system %v: %s: digest %s path %s, %d files; want %s %s %d", withSystem, name, d.Digest, d.Path, len(d.Files), want, dir, len(m.Parts()))
			}
			for i, np := range m.Parts() {
				f := d.Files[i]
				if f.Name != np.Name || f.Part != np.Part || f.Path != partPath(dir, np.Name) {
					t.Errorf("system %v: %s: file %d is %+v, want %+v", withSystem, name, i, f, np)
				}
			}
			if _, ok := d.File(manifest.PartSystem); ok != withSystem {
				t.Errorf("system %v: %s: File(system) found %v", withSystem, name, ok)
			}
		}
	}
}

// TestThroughSymlink reads a directory given as a symbolic link to it, as
// a nix build's ./result is.
func TestThroughSymlink(t *testing.T) {
	dir, _ := writeImage(t, true)
	link := filepath.Join(t.TempDir(), "result")
	if err := os.Symlink(dir, link); err != nil {
		t.Fatal(err)
	}
	d, err := Check(link)
	if err != nil {
		t.Fatal(err)
	}
	if d.Path != dir {
		t.Errorf("path %s, want the real directory %s", d.Path, dir)
	}
}

// TestHostile feeds Read and Check directories that are not valid images.
// Each must be refused with ErrInvalid and a message that names the
// problem; the cases Read cannot see (content) pass Read and fail Check.
func TestHostile(t *testing.T) {
	cases := []struct {
		name string
		// breaks the image dir, whose manifest is m; it returns the path
		// to read when that is not dir.
		breaks func(t *testing.T, dir string, m *manifest.Manifest) string
		// readOK is set when only Check can find the fault.
		readOK bool
		want   []string
	}{
		{
			name: "missing part",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				os.Remove(partPath(dir, manifest.PartInitrd))
				return ""
			},
			want: []string{"initrd.img is missing"},
		},
		{
			name: "missing hash device",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				os.Remove(partPath(dir, manifest.PartSystemVerity))
				return ""
			},
			want: []string{"system.verity is missing"},
		},
		{
			name: "extra file",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				writeRaw(t, filepath.Join(dir, "notes.txt"), []byte("hi"))
				return ""
			},
			want: []string{`"notes.txt" is not part of the image`},
		},
		{
			name: "extra part file",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				// A workspace template the manifest does not name.
				m.Workspace = nil
				writeManifest(t, dir, m)
				return ""
			},
			want: []string{`"workspace.img" is not part of the image`},
		},
		{
			name: "subdirectory",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				if err := os.Mkdir(filepath.Join(dir, "boot"), 0o755); err != nil {
					t.Fatal(err)
				}
				return ""
			},
			want: []string{`"boot" is not part of the image`},
		},
		{
			name: "part is a directory",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				os.Remove(partPath(dir, manifest.PartKernel))
				if err := os.Mkdir(partPath(dir, manifest.PartKernel), 0o755); err != nil {
					t.Fatal(err)
				}
				return ""
			},
			want: []string{"vmlinuz is a directory"},
		},
		{
			name: "part is a fifo",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				os.Remove(partPath(dir, manifest.PartKernel))
				if err := syscall.Mkfifo(partPath(dir, manifest.PartKernel), 0o644); err != nil {
					t.Fatal(err)
				}
				return ""
			},
			want: []string{"vmlinuz is a named pipe"},
		},
		{
			name: "part links inside",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				// The initrd as a link to a same-sized file in the dir
				// would read as the right bytes if links were followed.
				os.Remove(partPath(dir, manifest.PartInitrd))
				if err := os.Symlink(FileName(manifest.PartKernel), partPath(dir, manifest.PartInitrd)); err != nil {
					t.Fatal(err)
				}
				return ""
			},
			want: []string{"initrd.img is a symbolic link"},
		},
		{
			name: "part links outside",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				// The same bytes, outside the directory.
				outside := filepath.Join(t.TempDir(), "vmlinuz")
				if err := os.Rename(partPath(dir, manifest.PartKernel), outside); err != nil {
					t.Fatal(err)
				}
				if err := os.Symlink(outside, partPath(dir, manifest.PartKernel)); err != nil {
					t.Fatal(err)
				}
				return ""
			},
			want: []string{"vmlinuz is a symbolic link"},
		},
		{
			name: "manifest is a symlink",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				outside := filepath.Join(t.TempDir(), ManifestFile)
				if err := os.Rename(filepath.Join(dir, ManifestFile), outside); err != nil {
					t.Fatal(err)
				}
				if err := os.Symlink(outside, filepath.Join(dir, ManifestFile)); err != nil {
					t.Fatal(err)
				}
				return ""
			},
			want: []string{ManifestFile, "symbolic link"},
		},
		{
			name: "no manifest",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				os.Remove(filepath.Join(dir, ManifestFile))
				return ""
			},
			want: []string{ManifestFile, "did not finish"},
		},
		{
			name: "size differs",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				editPart(t, dir, manifest.PartKernel, func(b []byte) []byte { return append(b, 0) })
				return ""
			},
			want: []string{"vmlinuz is 13 bytes, the manifest says 12"},
		},
		{
			name: "system size differs",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				editPart(t, dir, manifest.PartSystem, func(b []byte) []byte { return b[:len(b)-4096] })
				return ""
			},
			want: []string{"system.erofs is", "the manifest says"},
		},
		{
			name: "digest differs",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				editPart(t, dir, manifest.PartInitrd, flip(3))
				return ""
			},
			readOK: true,
			want:   []string{"initrd.img hashes to", "the manifest says " + "sha256:"},
		},
		{
			name: "system digest differs",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				editPart(t, dir, manifest.PartSystem, flip(5000))
				return ""
			},
			readOK: true,
			want:   []string{"system.erofs hashes to"},
		},
		{
			name: "root hash disagrees with the tree",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				old, other := m.Verity.RootHash, strings.Repeat("5a", 32)
				m.Verity.RootHash = other
				m.Cmdline = strings.Replace(m.Cmdline, "roothash="+old, "roothash="+other, 1)
				writeManifest(t, dir, m)
				return ""
			},
			readOK: true,
			want:   []string{"verity", "root hash is"},
		},
		{
			name: "system changed, digest recomputed",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				b := editPart(t, dir, manifest.PartSystem, flip(7*4096+1))
				m.System.Digest = manifest.DigestBytes(b)
				writeManifest(t, dir, m)
				return ""
			},
			readOK: true,
			want:   []string{"verity", "differs"},
		},
		{
			name: "hash device changed, digest recomputed",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				b := editPart(t, dir, manifest.PartSystemVerity, flip(4096+9))
				m.SystemVerity.Digest = manifest.DigestBytes(b)
				writeManifest(t, dir, m)
				return ""
			},
			readOK: true,
			want:   []string{"verity", "differs"},
		},
		{
			name: "salt differs from the superblock",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				m.Verity.Salt = strings.Repeat("00", 32)
				writeManifest(t, dir, m)
				return ""
			},
			readOK: true,
			want:   []string{"verity", "salt"},
		},
		{
			name: "bad json",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				writeRaw(t, filepath.Join(dir, ManifestFile), []byte(`{"schema_version":2,"name":`))
				return ""
			},
			want: []string{ManifestFile, "decode"},
		},
		{
			name: "unknown field",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				b, _ := m.Marshal()
				b = append([]byte(`{"signature":"trust me",`), b[1:]...)
				writeRaw(t, filepath.Join(dir, ManifestFile), b)
				return ""
			},
			want: []string{ManifestFile, `unknown field "signature"`},
		},
		{
			name: "absurd size",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				m.Kernel.Size = 1 << 62
				b, err := json.Marshal(m) // not Marshal: that validates
				if err != nil {
					t.Fatal(err)
				}
				writeRaw(t, filepath.Join(dir, ManifestFile), b)
				return ""
			},
			want: []string{ManifestFile, "kernel", "size 4611686018427387904"},
		},
		{
			name: "manifest too large",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				b, _ := m.Marshal()
				// Valid JSON but for its size: trailing spaces.
				b = append(b, bytes.Repeat([]byte(" "), manifest.MaxSize+1-len(b))...)
				writeRaw(t, filepath.Join(dir, ManifestFile), b)
				return ""
			},
			want: []string{ManifestFile, "limit 4194304"},
		},
		{
			name: "not a directory",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				return filepath.Join(dir, ManifestFile)
			},
			want: []string{"is not a directory"},
		},
		{
			name: "missing directory",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				return filepath.Join(dir, "nowhere")
			},
			want: []string{"nowhere", "no such file"},
		},
		{
			name: "old result link",
			breaks: func(t *testing.T, dir string, m *manifest.Manifest) string {
				link := filepath.Join(t.TempDir(), "result")
				if err := os.Symlink(filepath.Join(dir, "collected"), link); err != nil {
					t.Fatal(err)
				}
				return link
			},
			want: []string{"result is a link to", "collected, which is gone"},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir, m := writeImage(t, true)
			path := dir
			if p := c.breaks(t, dir, m); p != "" {
				path = p
			}
			_, rerr := Read(path)
			_, cerr := Check(path)
			if c.readOK {
				if rerr != nil {
					t.Fatalf("Read: %v", rerr)
				}
			} else {
				checkErr(t, "Read", rerr, c.want)
			}
			checkErr(t, "Check", cerr, c.want)
		})
	}
}

func checkErr(t *testing.T, what string, err error, want []string) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s accepted the directory", what)
	}
	t.Logf("%s: %v", what, err)
	if !errors.Is(err, ErrInvalid) {
		t.Errorf("%s: %v does not wrap ErrInvalid", what, err)
	}
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%s: %q does not say %q", what, err, w)
		}
	}
}

func TestFileName(t *testing.T) {
	want := map[string]string{
		manifest.PartKernel:       "vmlinuz",
		manifest.PartInitrd:       "initrd.img",
		manifest.PartWorkspace:    "workspace.img",
		manifest.PartSystem:       "system.erofs",
		manifest.PartSystemVerity: "system.verity",
	}
	for part, name := range want {
		if got := FileName(part); got != name {
			t.Errorf("FileName(%q) = %q, want %q", part, got, name)
		}
	}
	if got := FileName("bogus"); got != "" {
		t.Errorf("FileName(bogus) = %q", got)
	}
}
