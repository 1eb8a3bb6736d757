package tests

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/image/devimage"
	"github.com/carrel-os/carrel/image/imagedir"
	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/image/store"
	"github.com/carrel-os/carrel/tests/harness"
)

// TestVerifiedRoot boots the dev image through dm-verity and checks what a
// VM keeps: its root is the verified erofs under an overlay whose upper
// layer is the VM's own disk; what it changes outside /workspace survives
// stop and start and a carreld killed with SIGKILL, and goes with vm reset,
// which keeps /workspace unless asked; an ephemeral VM keeps nothing.
func TestVerifiedRoot(t *testing.T) {
	d := harness.New(t)
	d.Start()
	digest := d.BuildImage()
	// The same inputs give the same image: a rebuild is the same digest.
	if again := d.BuildImage(); again != digest {
		t.Errorf("rebuild gave %s, first build %s", again, digest)
	}
	d.Must("vm", "create", "a")

	mounts := d.Must("exec", "a", "--", "cat", "/proc/mounts")
	for _, want := range []string{"overlay / overlay rw", "/dev/dm-0 /run/carrel/lower erofs ro", "/run/carrel/state ext4 rw"} {
		if !strings.Contains(mounts, want) {
			t.Errorf("no %q in /proc/mounts:\n%s", want, mounts)
		}
	}
	if out := d.Must("exec", "a", "--", "sha256sum", devimage.CanaryPath); !strings.HasPrefix(out, sha256Hex(devimage.Canary())) {
		t.Errorf("canary read back as %q", out)
	}
	var v struct {
		RootHash string `json:"rootHash"`
	}
	if err := json.Unmarshal([]byte(d.Must("vm", "inspect", "a")), &v); err != nil || len(v.RootHash) != 64 {
		t.Errorf("vm inspect: root hash %q, %v", v.RootHash, err)
	}

	d.Must("exec", "a", "--", "sh", "-c", "echo kept > /home/agent/kept && echo ws > /workspace/ws")
	d.Must("vm", "stop", "a")
	d.Must("vm", "start", "a")
	if out := d.Must("exec", "a", "--", "cat", "/home/agent/kept"); out != "kept\n" {
		t.Errorf("after stop and start: %q", out)
	}
	// carreld dies; the next one adopts the VM, and a run after that still
	// has the file.
	d.Kill()
	d.Start()
	d.Must("vm", "stop", "a")
	d.Must("vm", "start", "a")
	if out := d.Must("exec", "a", "--", "cat", "/home/agent/kept", "/workspace/ws"); out != "kept\nws\n" {
		t.Errorf("after carreld was killed, and stop and start: %q", out)
	}

	if out := d.Must("vm", "reset", "a"); !strings.Contains(out, "a reset, running") {
		t.Errorf("vm reset said %q", out)
	}
	if r := d.Carrel("exec", "a", "--", "cat", "/home/agent/kept"); r.Code == 0 {
		t.Errorf("the file outlived vm reset: %+v", r)
	}
	if out := d.Must("exec", "a", "--", "cat", "/workspace/ws"); out != "ws\n" {
		t.Errorf("vm reset lost /workspace: %q", out)
	}
	d.Must("vm", "reset", "--workspace", "a")
	if r := d.Carrel("exec", "a", "--", "cat", "/workspace/ws"); r.Code == 0 {
		t.Errorf("/workspace outlived vm reset --workspace: %+v", r)
	}
	d.Must("vm", "rm", "--force", "a")

	d.Must("vm", "create", "eph", "--ephemeral")
	d.Must("exec", "eph", "--", "sh", "-c", "echo gone > /home/agent/gone")
	if out := d.Must("exec", "eph", "--", "grep", " /run/carrel/state ", "/proc/mounts"); !strings.HasPrefix(out, "tmpfs ") {
		t.Errorf("ephemeral state: %q", out)
	}
	d.Must("vm", "stop", "eph")
	d.Must("vm", "start", "eph")
	if r := d.Carrel("exec", "eph", "--", "cat", "/home/agent/gone"); r.Code == 0 {
		t.Errorf("an ephemeral vm kept a file across stop and start: %+v", r)
	}
}

// TestVerifiedRootFaults: one damaged block of the stored root file system
// cannot be read in the guest (EIO), while the rest of the root still
// works; a full writable layer gives ENOSPC and nothing else breaks; a
// manifest whose root hash is wrong fails the create, naming verity (see
// TestBootFailures).
func TestVerifiedRootFaults(t *testing.T) {
	d := harness.New(t)
	d.Start()
	d.BuildImage()
	st := openStore(t, d)
	d.Must("vm", "create", "good")

	// Damage one byte of the canary's first block in the store's copy.
	dev, err := st.Resolve("dev")
	if err != nil {
		t.Fatal(err)
	}
	off := findBlock(t, dev.SystemPath, devimage.Canary()[:4096])
	flipByte(t, dev.SystemPath, off+100)

	d.Must("vm", "create", "small", "--disk", "64M")
	r := d.Carrel("exec", "small", "--", "cat", devimage.CanaryPath)
	if r.Code == 0 || !(strings.Contains(r.Stderr, "I/O error") || strings.Contains(r.Stderr, "Input/output error")) {
		t.Errorf("reading the damaged block: %+v", r)
	}
	if out := d.Must("exec", "small", "--", "sh", "-c", "echo still; ls /bin/sh"); out != "still\n/bin/sh\n" {
		t.Errorf("the rest of the root: %q", out)
	}
	console, _ := os.ReadFile(filepath.Join(d.State, "vms", "small", "console.log"))
	if !strings.Contains(string(console), "is corrupted") {
		t.Errorf("no dm-verity corruption report on the console:\n%s", tail(string(console), 20))
	}

	// The writable layer fills: ENOSPC, and the VM, carreld and the other
	// VM go on.
	r = d.Carrel("exec", "small", "--", "dd", "if=/dev/zero", "of=/home/agent/fill", "bs=1M", "count=256")
	if r.Code == 0 || !strings.Contains(r.Stderr, "No space left on device") {
		t.Errorf("filling the writable layer: %+v", r)
	}
	d.Must("exec", "small", "--", "rm", "/home/agent/fill")
	if out := d.Must("exec", "small", "--", "sh", "-c", "echo after > /home/agent/a && cat /home/agent/a"); out != "after\n" {
		t.Errorf("after the disk was full: %q", out)
	}
	if out := d.Must("exec", "good", "--", "echo", "fine"); out != "fine\n" {
		t.Errorf("the other vm: %q", out)
	}
	d.Must("info")
}

// TestImageImportAndCheck exports the dev image as an image directory,
// checks it and imports it with the CLI, then shows that an import of a
// hostile directory fails clearly and changes nothing.
func TestImageImportAndCheck(t *testing.T) {
	d := harness.New(t)
	d.Start()
	digest := d.BuildImage()
	st := openStore(t, d)
	dir := exportImage(t, st, "dev")

	if out := d.Must("image", "check", dir); !strings.Contains(out, "ok") || !strings.Contains(out, digest) {
		t.Errorf("image check: %q", out)
	}
	if out := d.Must("image", "import", dir, "--tag", "copy"); !strings.Contains(out, digest+" imported as copy") {
		t.Errorf("image import: %q", out)
	}
	if out := d.Must("image", "import", dir, "--tag", "copy"); !strings.Contains(out, "already imported") {
		t.Errorf("second import: %q", out)
	}
	inspect := d.Must("image", "inspect", "copy")
	for _, want := range []string{`"root_hash"`, `"data_blocks"`, `"busybox-static"`, digest} {
		if !strings.Contains(inspect, want) {
			t.Errorf("image inspect lacks %s:\n%s", want, inspect)
		}
	}

	for format, want := range map[string]string{"spdx": `"spdxVersion": "SPDX-2.3"`, "cyclonedx": `"bomFormat": "CycloneDX"`} {
		if out := d.Must("image", "sbom", "copy", "--format", format); !strings.Contains(out, want) || !strings.Contains(out, "pkg:deb/debian/busybox-static@") {
			t.Errorf("image sbom --format %s:\n%.400s", format, out)
		}
	}

	before := d.Must("image", "ls")
	if err := os.WriteFile(filepath.Join(dir, "extra"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"image", "check", dir}, {"image", "import", dir, "--tag", "hostile"}} {
		r := d.Carrel(args...)
		if r.Code == 0 || !strings.Contains(r.Stderr, `"extra" is not part of the image`) {
			t.Errorf("carrel %v: %+v", args, r)
		}
	}
	if after := d.Must("image", "ls"); after != before {
		t.Errorf("a failed import changed the store:\n%s\n%s", before, after)
	}
}

// exportImage copies a stored image into an image directory.
func exportImage(t *testing.T, st *store.Store, ref string) string {
	t.Helper()
	r, err := st.Resolve(ref)
	if err != nil {
		t.Fatal(err)
	}
	b, err := st.ManifestBytes(r.Digest)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, imagedir.ManifestFile), b, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, p := range r.Manifest.Parts() {
		copyFile(t, filepath.Join(st.Dir(), "blobs", "sha256", strings.TrimPrefix(p.Part.Digest, manifest.DigestPrefix)),
			filepath.Join(dir, imagedir.FileName(p.Name)))
	}
	return dir
}

func copyFile(t *testing.T, src, dst string) {
	t.Helper()
	in, err := os.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
}

// findBlock returns the offset of the 4 KiB-aligned block of path that
// holds want.
func findBlock(t *testing.T, path string, want []byte) int64 {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for off := 0; off+len(want) <= len(b); off += 4096 {
		if bytes.Equal(b[off:off+len(want)], want) {
			return int64(off)
		}
	}
	t.Fatalf("no block of %s holds the canary", path)
	return 0
}

// flipByte inverts one byte of a read-only store file in place.
func flipByte(t *testing.T, path string, off int64) {
	t.Helper()
	if err := os.Chmod(path, 0o644); err != nil {
		t.Fatal(err)
	}
	defer os.Chmod(path, 0o444)
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var b [1]byte
	if _, err := f.ReadAt(b[:], off); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0xff
	if _, err := f.WriteAt(b[:], off); err != nil {
		t.Fatal(err)
	}
}

func sha256Hex(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
