package workspace

import (
	"context"
	"crypto/sha256"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func need(t *testing.T, tools ...string) {
	t.Helper()
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			if os.Getenv("CARREL_REQUIRE_VM") == "1" {
				t.Fatalf("%s is missing and CARREL_REQUIRE_VM=1: run `make deps`", tool)
			}
			t.Skipf("%s is missing (e2fsprogs, qemu-utils): run `make deps`", tool)
		}
	}
}

func sum(t *testing.T, path string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}

func TestTemplateIsReproducibleExt4(t *testing.T) {
	need(t, "mkfs.ext4", "dumpe2fs", "debugfs")
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a.img"), filepath.Join(dir, "b.img")
	for _, p := range []string{a, b} {
		if err := Template(context.Background(), p); err != nil {
			t.Fatal(err)
		}
	}
	if sum(t, a) != sum(t, b) {
		t.Error("two builds of the template differ")
	}
	if fi, err := os.Stat(a); err != nil || fi.Size() != TemplateSize {
		t.Fatalf("template: %v, %v", fi, err)
	}
	out, err := exec.Command("dumpe2fs", "-h", a).Output()
	if err != nil {
		t.Fatal(err)
	}
	h := string(out)
	for _, want := range []string{
		"Filesystem volume name:   workspace",
		"Block size:               4096",
		"Reserved block count:     0",
		"Inodes per group:         8192",
		"Filesystem UUID:          " + fsUUID,
	} {
		if !strings.Contains(h, want) {
			t.Errorf("dumpe2fs lacks %q:\n%s", want, h)
		}
	}
	// Enough reserved descriptor blocks to grow to MaxSize online: 8192
	// groups of 64-byte descriptors.
	if !strings.Contains(h, "Reserved GDT blocks:      127") && !strings.Contains(h, "Reserved GDT blocks:      128") {
		t.Errorf("reserved gdt blocks:\n%s", h)
	}
	// The root belongs to the agent's user.
	st, err := exec.Command("debugfs", "-R", "stat /", a).Output()
	if err != nil || !strings.Contains(string(st), "User:  1000   Group:  1000") {
		t.Errorf("root of the template: %v\n%s", err, st)
	}
}

func TestCreateBacksTheDiskWithTheTemplate(t *testing.T) {
	need(t, "mkfs.ext4", "qemu-img")
	dir := t.TempDir()
	tpl := filepath.Join(dir, "template")
	if err := Template(context.Background(), tpl); err != nil {
		t.Fatal(err)
	}
	disk := filepath.Join(dir, "vm", "workspace.qcow2")
	if err := os.Mkdir(filepath.Dir(disk), 0o700); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := Create(ctx, "qemu-img", disk, tpl, 64<<20); err != nil {
		t.Fatal(err)
	}
	i, err := Inspect(ctx, "qemu-img", disk)
	if err != nil {
		t.Fatal(err)
	}
	if i.Format != "qcow2" || i.VirtualSize != 64<<20 || i.BackingFilename != tpl || i.BackingFormat != "raw" {
		t.Errorf("disk: %+v", i)
	}
	// Copy-on-write: the disk holds none of the template's blocks.
	if fi, err := os.Stat(disk); err != nil || fi.Size() > 1<<20 {
		t.Errorf("new disk is %d bytes: %v", fi.Size(), err)
	}
	if err := Create(ctx, "qemu-img", disk, tpl, 64<<20); !errors.Is(err, os.ErrExist) {
		t.Errorf("second create over the disk: %v", err)
	}
	for _, bad := range []uint64{TemplateSize - 1<<20, 64<<20 + 1, MaxSize + 1<<20} {
		if err := Create(ctx, "qemu-img", filepath.Join(dir, "bad.qcow2"), tpl, bad); err == nil {
			t.Errorf("size %d accepted", bad)
		}
	}
	if err := Create(ctx, "qemu-img", filepath.Join(dir, "rel.qcow2"), "template", 64<<20); err == nil {
		t.Error("a relative template accepted")
	}
	if _, err := os.Stat(filepath.Join(dir, "bad.qcow2")); !os.IsNotExist(err) {
		t.Errorf("refused create left a file: %v", err)
	}
}

func TestQEMUImg(t *testing.T) {
	if got := QEMUImg("/nix/store/x-qemu/bin/qemu-system-x86_64"); got != "/nix/store/x-qemu/bin/qemu-img" {
		t.Errorf("nix: %q", got)
	}
	if got := QEMUImg("qemu-system-x86_64"); got != "qemu-img" {
		t.Errorf("on PATH: %q", got)
	}
}
