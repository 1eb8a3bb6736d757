package devimage

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestParseAptShow(t *testing.T) {
	out := `Package: linux-image-amd64
Source: linux-signed-amd64 (6.1.192+2)
Version: 6.1.192-2
Architecture: amd64
Depends: linux-image-6.1.0-56-amd64 (= 6.1.192-2)
Description: Linux for 64-bit PCs (meta-package)
 This package depends on the latest Linux kernel
SHA256: 45457bcfc86c87585800b5656bdf2773b063a3bb95486b0e820d51e870491f8d

Package: linux-image-amd64
Version: 6.1.0-old
Architecture: amd64
`
	pkgs, err := parseAptShow([]byte(out))
	if err != nil {
		t.Fatal(err)
	}
	if len(pkgs) != 2 || pkgs[1].Version != "6.1.0-old" {
		t.Fatalf("parsed %+v", pkgs)
	}
	p := pkgs[0]
	if p.Name != "linux-image-amd64" || p.Version != "6.1.192-2" || p.Arch != "amd64" ||
		p.SHA256 != "45457bcfc86c87585800b5656bdf2773b063a3bb95486b0e820d51e870491f8d" ||
		strings.Join(p.Depends, ",") != "linux-image-6.1.0-56-amd64" {
		t.Errorf("parsed %+v", p)
	}
	if pkgs, err := parseAptShow([]byte("N: nothing\n")); err != nil || len(pkgs) != 0 {
		t.Errorf("no stanzas: %v %v", pkgs, err)
	}
	if _, err := parseAptShow([]byte("Package: x\n\n")); err == nil {
		t.Error("stanza without version accepted")
	}
	got := parseDepends("kmod, linux-base (>= 4.3~), initramfs-tools (>= 0.120+deb8u2) | linux-initramfs-tool, libc6:any,")
	if strings.Join(got, " ") != "kmod linux-base initramfs-tools libc6" {
		t.Errorf("parseDepends = %v", got)
	}
	bb := debPackage{Name: "busybox-static", Version: "1:1.35.0-4+deb12u1+b1", Arch: "amd64"}
	if bb.fileName() != "busybox-static_1%3a1.35.0-4+deb12u1+b1_amd64.deb" {
		t.Errorf("fileName = %s", bb.fileName())
	}
}

// fakeApt stands in for apt-cache, apt-get and dpkg-deb.
type fakeApt struct {
	t       *testing.T
	lists   bool // apt-get update has run
	pkgs    map[string]string
	calls   []string
	badHash bool
}

func debContent(name string) string { return "deb:" + name }

func (f *fakeApt) run(ctx context.Context, dir string, argv ...string) ([]byte, error) {
	f.calls = append(f.calls, strings.Join(argv, " "))
	switch strings.Join(argv[:2], " ") {
	case "apt-cache show":
		if !f.lists {
			return nil, errors.New("E: No packages found")
		}
		var out []byte
		for _, name := range argv[3:] {
			deps, ok := f.pkgs[name]
			if !ok {
				return nil, errors.New("E: No packages found")
			}
			sum := sha256.Sum256([]byte(debContent(name)))
			out = fmt.Appendf(out, "Package: %s\nVersion: 1:1.0-1\nArchitecture: amd64\nDepends: %s\nSHA256: %s\n\n",
				name, deps, hex.EncodeToString(sum[:]))
		}
		return out, nil
	case "apt-get update":
		f.lists = true
		return nil, nil
	case "apt-get download":
		name, _, _ := strings.Cut(argv[2], "=")
		content := debContent(name)
		if f.badHash {
			content += "!"
		}
		return nil, os.WriteFile(filepath.Join(dir, name+"_1%3a1.0-1_amd64.deb"), []byte(content), 0o644)
	case "dpkg-deb -x":
		deb, dst := argv[2], argv[3]
		b, err := os.ReadFile(deb)
		if err != nil {
			return nil, err
		}
		return nil, os.WriteFile(filepath.Join(dst, "content"), b, 0o644)
	}
	f.t.Fatalf("unexpected command %v", argv)
	return nil, nil
}

func (f *fakeApt) count(prefix string) int {
	n := 0
	for _, c := range f.calls {
		if strings.HasPrefix(c, prefix) {
			n++
		}
	}
	return n
}

func TestFetcherUpdatesOnceAndCaches(t *testing.T) {
	fa := &fakeApt{t: t, pkgs: map[string]string{
		"linux-image-amd64":         "linux-image-6.1.0-9-amd64 (= 1:1.0-1)",
		"linux-image-6.1.0-9-amd64": "kmod, linux-base (>= 4.3~)",
		"busybox-static":            "",
	}}
	cache := t.TempDir()
	f, err := newFetcher(cache, quietLogger(), fa.run)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	got, err := f.fetch(ctx, "linux-image-amd64", "busybox-static")
	if err != nil {
		t.Fatal(err)
	}
	tree, p := got[0].tree, got[0].pkg
	if got[1].pkg.Name != "busybox-static" {
		t.Errorf("second package %s", got[1].pkg.Name)
	}
	if p.Name != "linux-image-6.1.0-9-amd64" {
		t.Errorf("followed to %s", p.Name)
	}
	if b, err := os.ReadFile(filepath.Join(tree, "content")); err != nil || string(b) != debContent(p.Name) {
		t.Errorf("tree content %q %v", b, err)
	}
	if filepath.Base(tree) != "linux-image-6.1.0-9-amd64_1%3a1.0-1_amd64" {
		t.Errorf("tree %s", tree)
	}
	if fa.count("apt-get update") != 1 || fa.count("apt-get download") != 2 || fa.count("dpkg-deb") != 2 || fa.count("apt-cache") != 3 {
		t.Errorf("calls: %q", fa.calls)
	}

	// A second build reuses the cache: no download, no unpack, no update.
	fa.calls = nil
	f2, err := newFetcher(cache, quietLogger(), fa.run)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f2.fetch(ctx, "linux-image-amd64", "busybox-static"); err != nil {
		t.Fatal(err)
	}
	if fa.count("apt-get") != 0 || fa.count("dpkg-deb") != 0 {
		t.Errorf("warm cache calls: %q", fa.calls)
	}
	// Nothing temporary is left behind.
	for _, d := range []string{"debs", "trees"} {
		des, _ := os.ReadDir(filepath.Join(cache, d))
		for _, de := range des {
			if strings.HasPrefix(de.Name(), ".") {
				t.Errorf("leftover %s/%s", d, de.Name())
			}
		}
	}

	// A damaged cached .deb is fetched again.
	deb := filepath.Join(cache, "debs", "linux-image-6.1.0-9-amd64_1%3a1.0-1_amd64.deb")
	if err := os.WriteFile(deb, []byte("junk"), 0o644); err != nil {
		t.Fatal(err)
	}
	fa.calls = nil
	if _, err := f2.fetch(ctx, "linux-image-amd64", "busybox-static"); err != nil {
		t.Fatal(err)
	}
	if fa.count("apt-get download") != 1 {
		t.Errorf("damaged deb not re-fetched: %q", fa.calls)
	}
}

func TestFetcherErrors(t *testing.T) {
	ctx := context.Background()
	fa := &fakeApt{t: t, pkgs: map[string]string{}}
	f, err := newFetcher(t.TempDir(), quietLogger(), fa.run)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.fetch(ctx, "nonexistent"); err == nil || !strings.Contains(err.Error(), "No packages found") {
		t.Errorf("unknown package: %v", err)
	}
	if _, err := f.fetch(ctx, "nonexistent"); err == nil || fa.count("apt-get update") != 1 {
		t.Errorf("apt-get update ran %d times", fa.count("apt-get update"))
	}

	fa = &fakeApt{t: t, lists: true, badHash: true, pkgs: map[string]string{"busybox-static": ""}}
	f, err = newFetcher(t.TempDir(), quietLogger(), fa.run)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.fetch(ctx, "busybox-static"); err == nil || !strings.Contains(err.Error(), "apt expects") {
		t.Errorf("hash mismatch: %v", err)
	}

	fa = &fakeApt{t: t, lists: true, pkgs: map[string]string{"a": "linux-image-b", "linux-image-b": "linux-image-a", "linux-image-a": "linux-image-b"}}
	f, err = newFetcher(t.TempDir(), quietLogger(), fa.run)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.fetch(ctx, "a"); err == nil || !strings.Contains(err.Error(), "meta packages") {
		t.Errorf("meta package loop: %v", err)
	}
}
