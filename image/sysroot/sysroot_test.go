package sysroot

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/image/erofs"
	"github.com/carrel-os/carrel/image/imagedir"
	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/image/verity"
)

func needMkfsErofs(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("mkfs.erofs"); err != nil {
		t.Skip("mkfs.erofs not found; install erofs-utils")
	}
}

// writeTree lays out the same small tree under dir each time, with every
// timestamp set to mtime, so that two trees differ only in when they were
// made.
func writeTree(t *testing.T, dir string, mtime time.Time) {
	t.Helper()
	files := map[string]string{
		"etc/hostname":            "carrel\n",
		"bin/busybox":             "#!/bin/sh\n",
		"usr/share/doc/README":    strings.Repeat("readme ", 2000), // more than a block
		"usr/share/doc/empty.txt": "",
	}
	for name, content := range files {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(filepath.Join(dir, "bin/busybox"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/bin/busybox", filepath.Join(dir, "bin/sh")); err != nil {
		t.Fatal(err)
	}
	if err := filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err != nil || fi.Mode()&os.ModeSymlink != 0 {
			return err
		}
		return os.Chtimes(p, mtime, mtime)
	}); err != nil {
		t.Fatal(err)
	}
}

type built struct {
	res             *Result
	system, verity  string
	sysData, hashes []byte
}

func make1(t *testing.T, mtime time.Time) built {
	t.Helper()
	dir := t.TempDir()
	tree := filepath.Join(dir, "tree")
	writeTree(t, tree, mtime)
	b := built{system: filepath.Join(dir, "system.erofs"), verity: filepath.Join(dir, "system.verity")}
	res, err := Make(context.Background(), tree, b.system, b.verity, Options{})
	if err != nil {
		t.Fatal(err)
	}
	b.res = res
	if b.sysData, err = os.ReadFile(b.system); err != nil {
		t.Fatal(err)
	}
	if b.hashes, err = os.ReadFile(b.verity); err != nil {
		t.Fatal(err)
	}
	return b
}

func TestMakeReproducible(t *testing.T) {
	needMkfsErofs(t)
	a := make1(t, time.Unix(1_000_000, 0))
	time.Sleep(1100 * time.Millisecond) // let clocks pass a second; nothing may depend on them
	b := make1(t, time.Unix(2_000_000_000, 0))
	if !bytes.Equal(a.sysData, b.sysData) {
		t.Error("the two file systems differ")
	}
	if !bytes.Equal(a.hashes, b.hashes) {
		t.Error("the two hash devices differ")
	}
	if !reflect.DeepEqual(a.res, b.res) {
		t.Errorf("results differ:\n%+v\n%+v", a.res, b.res)
	}
}

func TestMakeResult(t *testing.T) {
	needMkfsErofs(t)
	b := make1(t, time.Now())
	r := b.res
	sum := sha256.Sum256(b.sysData)
	if r.System.Digest != manifest.DigestPrefix+hex.EncodeToString(sum[:]) || r.System.Size != int64(len(b.sysData)) {
		t.Errorf("system part %+v does not describe the file", r.System)
	}
	if r.System.Size%erofs.BlockSize != 0 || r.Verity.DataBlocks*uint64(erofs.BlockSize) != uint64(r.System.Size) {
		t.Errorf("system is %d bytes, verity covers %d blocks", r.System.Size, r.Verity.DataBlocks)
	}
	if r.SystemVerity.Digest != manifest.DigestBytes(b.hashes) || r.SystemVerity.Size != int64(len(b.hashes)) {
		t.Errorf("hash device part %+v does not describe the file", r.SystemVerity)
	}
	// The salt is the file system's digest.
	if r.Verity.Salt != hex.EncodeToString(sum[:]) || r.Verity.Mount != manifest.MountRoot {
		t.Errorf("verity %+v", r.Verity)
	}
	wantWords := []string{
		"roothash=" + r.Verity.RootHash,
		"systemd.verity_root_data=" + protocol.DiskByIDPrefix + protocol.SystemSerial,
		"systemd.verity_root_hash=" + protocol.DiskByIDPrefix + protocol.SystemVeritySerial,
	}
	if r.Cmdline != strings.Join(wantWords, " ") {
		t.Errorf("cmdline %q, want %q", r.Cmdline, strings.Join(wantWords, " "))
	}

	// The result is what a manifest records, and both verifiers accept it.
	m := &manifest.Manifest{
		SchemaVersion: manifest.SchemaVersion, Name: "test", Arch: "amd64", KernelVersion: "6.1.0-test",
		Kernel: manifest.Part{Digest: manifest.DigestBytes([]byte("k")), Size: 1},
		Initrd: manifest.Part{Digest: manifest.DigestBytes([]byte("i")), Size: 1},
		System: &r.System, SystemVerity: &r.SystemVerity, Verity: &r.Verity,
		Cmdline: "console=ttyS0 " + r.Cmdline,
	}
	if err := m.Validate(); err != nil {
		t.Fatalf("manifest of the result: %v", err)
	}
	if err := imagedir.VerifySystem(m, b.system, b.verity); err != nil {
		t.Errorf("VerifySystem: %v", err)
	}
	p, root, err := r.Verity.Params()
	if err != nil {
		t.Fatal(err)
	}
	if err := verity.Verify(bytes.NewReader(b.sysData), r.System.Size, bytes.NewReader(b.hashes), r.SystemVerity.Size, p, root); err != nil {
		t.Errorf("verity.Verify: %v", err)
	}
	// One changed data byte is caught.
	bad := bytes.Clone(b.sysData)
	bad[len(bad)/2] ^= 1
	if err := verity.Verify(bytes.NewReader(bad), r.System.Size, bytes.NewReader(b.hashes), r.SystemVerity.Size, p, root); err == nil {
		t.Error("verity.Verify accepted a changed file system")
	}

	if vs, err := exec.LookPath("veritysetup"); err != nil {
		t.Log("veritysetup not found; not checked against cryptsetup")
	} else {
		out, err := exec.Command(vs, "verify", b.system, b.verity, r.Verity.RootHash).CombinedOutput()
		if err != nil {
			t.Errorf("veritysetup verify: %v\n%s", err, out)
		}
		wrong := strings.Repeat("0", 64)
		if out, err := exec.Command(vs, "verify", b.system, b.verity, wrong).CombinedOutput(); err == nil {
			t.Errorf("veritysetup verify accepted a wrong root hash:\n%s", out)
		}
	}
}

func TestSealUsr(t *testing.T) {
	dir := t.TempDir()
	sys, hash := filepath.Join(dir, "system"), filepath.Join(dir, "hash")
	if err := os.WriteFile(sys, bytes.Repeat([]byte("usr!"), 3*erofs.BlockSize/4), 0o644); err != nil {
		t.Fatal(err)
	}
	r, err := Seal(sys, hash, manifest.MountUsr)
	if err != nil {
		t.Fatal(err)
	}
	if r.Verity.Mount != manifest.MountUsr || r.Verity.DataBlocks != 3 ||
		!strings.HasPrefix(r.Cmdline, "usrhash="+r.Verity.RootHash+" systemd.verity_usr_data=") {
		t.Errorf("result %+v", r)
	}
	m := &manifest.Manifest{System: &r.System, SystemVerity: &r.SystemVerity, Verity: &r.Verity}
	if err := imagedir.VerifySystem(m, sys, hash); err != nil {
		t.Error(err)
	}
}

func TestSealRejects(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good")
	if err := os.WriteFile(good, make([]byte, erofs.BlockSize), 0o644); err != nil {
		t.Fatal(err)
	}
	for name, size := range map[string]int{"ragged": erofs.BlockSize + 1, "short": erofs.BlockSize - 1, "empty": 0} {
		t.Run(name, func(t *testing.T) {
			p := filepath.Join(dir, name)
			if err := os.WriteFile(p, make([]byte, size), 0o644); err != nil {
				t.Fatal(err)
			}
			hash := filepath.Join(dir, name+".verity")
			_, err := Seal(p, hash, "")
			if err == nil || !strings.Contains(err.Error(), "whole number") {
				t.Errorf("Seal of %d bytes: %v", size, err)
			}
			if _, err := os.Lstat(hash); !os.IsNotExist(err) {
				t.Errorf("hash device written: %v", err)
			}
		})
	}
	for _, mount := range []string{"home", "ROOT", "/"} {
		hash := filepath.Join(dir, "mount.verity")
		if _, err := Seal(good, hash, mount); err == nil || !strings.Contains(err.Error(), "mount") {
			t.Errorf("Seal with mount %q: %v", mount, err)
		}
		if _, err := os.Lstat(hash); !os.IsNotExist(err) {
			t.Errorf("mount %q: hash device written: %v", mount, err)
		}
	}
	if _, err := Seal(filepath.Join(dir, "missing"), filepath.Join(dir, "missing.verity"), ""); err == nil {
		t.Error("Seal of a missing file succeeded")
	}
}

func TestMakeFails(t *testing.T) {
	dir := t.TempDir()
	sys, hash := filepath.Join(dir, "system"), filepath.Join(dir, "hash")
	noMkfs := Options{Erofs: erofs.Options{MkfsErofs: "carrel-test-no-such-mkfs.erofs"}}
	if _, err := Make(context.Background(), dir, sys, hash, noMkfs); err == nil || !strings.Contains(err.Error(), "erofs-utils") {
		t.Errorf("missing mkfs.erofs: %v", err)
	}
	if _, err := exec.LookPath("mkfs.erofs"); err == nil {
		if _, err := Make(context.Background(), filepath.Join(dir, "no-tree"), sys, hash, Options{}); err == nil {
			t.Error("Make of a missing tree succeeded")
		}
	}
	for _, p := range []string{sys, hash} {
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Errorf("%s left behind: %v", p, err)
		}
	}
}
