package pack

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/image/imagedir"
	"github.com/carrel-os/carrel/image/manifest"
)

func TestParseDrvName(t *testing.T) {
	for _, c := range []struct{ in, name, version string }{
		{"hello-2.12.1", "hello", "2.12.1"},
		{"python3.12-numpy-2.1.3", "python3.12-numpy", "2.1.3"},
		{"util-linux-2.41-lib", "util-linux", "2.41-lib"},
		{"glibc-2.40-66-bin", "glibc", "2.40-66-bin"},
		{"nixos-system-agent-26.05.20260101.abcdef0", "nixos-system-agent", "26.05.20260101.abcdef0"},
		{"etc", "etc", ""},
		{"unit-carrel-agent.service", "unit-carrel-agent.service", ""},
		{"x-", "x-", ""},
		{"openssl-3.0.15-etc", "openssl", "3.0.15-etc"},
	} {
		if n, v := ParseDrvName(c.in); n != c.name || v != c.version {
			t.Errorf("ParseDrvName(%q) = %q, %q; want %q, %q", c.in, n, v, c.name, c.version)
		}
	}
}

func TestNixPackages(t *testing.T) {
	closure := strings.Join([]string{
		"/nix/store/00bgd045z0d4icpbc2yyz4gx48ak44la-hello-2.12.1",
		"/nix/store/11bgd045z0d4icpbc2yyz4gx48ak44la-glibc-2.40-66",
		"/nix/store/22bgd045z0d4icpbc2yyz4gx48ak44la-glibc-2.40-66",
		"",
		"/nix/store/33bgd045z0d4icpbc2yyz4gx48ak44la-etc",
	}, "\n")
	got, err := NixPackages(strings.NewReader(closure))
	if err != nil {
		t.Fatal(err)
	}
	want := []manifest.Package{{Name: "etc"}, {Name: "glibc", Version: "2.40-66"}, {Name: "hello", Version: "2.12.1"}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("NixPackages = %+v; want %+v", got, want)
	}
	for _, bad := range []string{
		"/usr/lib/libc.so",
		"/nix/store/short-hello",
		"/nix/store/00bgd045z0d4icpbc2yyz4gx48ak44la-hello/bin/hello",
		"/nix/store/00bgd045z0d4icpbc2yyz4gx48ak44la_hello",
	} {
		if _, err := NixPackages(strings.NewReader(bad + "\n")); err == nil || !strings.Contains(err.Error(), "not a store path") {
			t.Errorf("NixPackages(%q) = %v; want not a store path", bad, err)
		}
	}
	huge := strings.Repeat("/nix/store/00bgd045z0d4icpbc2yyz4gx48ak44la-a-1\n", maxClosurePaths+1)
	if _, err := NixPackages(strings.NewReader(huge)); err == nil || !strings.Contains(err.Error(), "more than") {
		t.Errorf("a closure over the limit: %v", err)
	}
}

// parts lays out a kernel, an initrd and a small store tree, as a NixOS
// derivation has them.
func parts(t *testing.T) Parts {
	t.Helper()
	for _, tool := range []string{"mkfs.erofs", "mkfs.ext4"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skip(tool + " not found; install erofs-utils and e2fsprogs")
		}
	}
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	write("store/nix/store/00bgd045z0d4icpbc2yyz4gx48ak44la-hello-2.12.1/bin/hello", strings.Repeat("hello ", 3000))
	return Parts{
		Name:          "nixos-agent",
		KernelVersion: "6.12.30",
		Kernel:        write("kernel/bzImage", "a kernel"),
		Initrd:        write("initrd/initrd", "an initrd"),
		System:        filepath.Join(dir, "store"),
		Mount:         manifest.MountUsr,
		Cmdline:       "init=/nix/store/22bgd045z0d4icpbc2yyz4gx48ak44la-nixos-system-agent/init console=ttyS0 debugfs=off",
		Packages:      []manifest.Package{{Name: "hello", Version: "2.12.1"}},
	}
}

func TestPack(t *testing.T) {
	p := parts(t)
	p.Erofs.AllRoot = true
	out := filepath.Join(t.TempDir(), "image")
	m, err := Pack(context.Background(), out, p)
	if err != nil {
		t.Fatal(err)
	}
	d, err := imagedir.Check(out)
	if err != nil {
		t.Fatalf("the packed image does not check: %v", err)
	}
	if d.Manifest.Verity.Mount != manifest.MountUsr || m.Workspace == nil || m.KernelVersion != "6.12.30" {
		t.Errorf("manifest: %+v", d.Manifest)
	}
	for _, w := range []string{p.Cmdline + " usrhash=" + m.Verity.RootHash,
		"systemd.verity_usr_data=/dev/disk/by-id/virtio-carrel-system",
		"systemd.verity_usr_hash=/dev/disk/by-id/virtio-carrel-system-verity"} {
		if !strings.Contains(m.Cmdline, w) {
			t.Errorf("cmdline %q lacks %q", m.Cmdline, w)
		}
	}
	first, _ := m.Marshal()

	// Packing the same parts again gives the same image, byte for byte.
	again := filepath.Join(t.TempDir(), "again")
	m2, err := Pack(context.Background(), again, p)
	if err != nil {
		t.Fatal(err)
	}
	if second, _ := m2.Marshal(); string(first) != string(second) {
		t.Errorf("two packs differ:\n%s\n%s", first, second)
	}
	// An erofs image given as a file is taken as it is: the same root.
	p.System = filepath.Join(out, imagedir.FileName(manifest.PartSystem))
	m3, err := Pack(context.Background(), filepath.Join(t.TempDir(), "from-file"), p)
	if err != nil {
		t.Fatal(err)
	}
	if m3.Verity.RootHash != m.Verity.RootHash || m3.System.Digest != m.System.Digest {
		t.Errorf("packing the erofs file changed the root: %+v vs %+v", m3.Verity, m.Verity)
	}
}

func TestPackRefuses(t *testing.T) {
	p := parts(t)
	for name, c := range map[string]struct {
		edit func(p *Parts)
		want string
	}{
		"verity words": {func(p *Parts) { p.Cmdline += " usrhash=00" }, "already has usrhash="},
		"bad name":     {func(p *Parts) { p.Name = "NixOS Agent" }, "image name"},
		"no kernel":    {func(p *Parts) { p.Kernel = "" }, "required"},
		"bad mount":    {func(p *Parts) { p.Mount = "home" }, `mount "home"`},
		"dir initrd":   {func(p *Parts) { p.Initrd = filepath.Dir(p.Initrd) }, "not a regular file"},
	} {
		q := p
		c.edit(&q)
		_, err := Pack(context.Background(), filepath.Join(t.TempDir(), "out"), q)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v; want %q", name, err, c.want)
		}
	}
}

// A pack that fails over an earlier image leaves no manifest: the
// directory is then refused as unfinished, not taken for the old image.
func TestPackFailureLeavesNoManifest(t *testing.T) {
	p := parts(t)
	out := filepath.Join(t.TempDir(), "image")
	if _, err := Pack(context.Background(), out, p); err != nil {
		t.Fatal(err)
	}
	p.System = filepath.Join(t.TempDir(), "missing")
	if _, err := Pack(context.Background(), out, p); err == nil {
		t.Fatal("a pack of a missing system succeeded")
	}
	if _, err := os.Stat(filepath.Join(out, imagedir.ManifestFile)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("manifest after a failed pack: %v", err)
	}
	if _, err := imagedir.Read(out); err == nil || !strings.Contains(err.Error(), "did not finish") {
		t.Errorf("reading the unfinished image: %v", err)
	}
}
