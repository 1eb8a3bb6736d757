package kmod_test

import (
	"bytes"
	"compress/gzip"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/image/kmod"
	"github.com/carrel-os/carrel/image/kmod/kmodtest"
	"github.com/ulikunitz/xz"
)

const release = "6.1.0-test-amd64"

func names(ms []*kmod.Module) string {
	var out []string
	for _, m := range ms {
		out = append(out, m.Name)
	}
	return strings.Join(out, " ")
}

func TestParseModinfo(t *testing.T) {
	mi, err := kmod.ParseModinfo(kmodtest.ELF("alias=a", "depends=virtio,virtio_ring", "alias=b", "name=virtio_blk"))
	if err != nil {
		t.Fatal(err)
	}
	if mi.Get("depends") != "virtio,virtio_ring" || mi.Get("name") != "virtio_blk" || !slices.Equal(mi["alias"], []string{"a", "b"}) {
		t.Fatalf("modinfo = %v", mi)
	}
	if mi.Get("absent") != "" {
		t.Fatal("Get of absent key not empty")
	}
	if _, err := kmod.ParseModinfo([]byte("not an elf")); err == nil {
		t.Fatal("ParseModinfo accepted garbage")
	}
}

func writeTree(t *testing.T, mods ...kmodtest.Module) string {
	t.Helper()
	root, err := kmodtest.WriteTree(t.TempDir(), release, mods...)
	if err != nil {
		t.Fatal(err)
	}
	return root
}

func TestClosureOrder(t *testing.T) {
	root := writeTree(t,
		kmodtest.Module{Rel: "kernel/drivers/virtio/virtio.ko"},
		kmodtest.Module{Rel: "kernel/drivers/virtio/virtio_ring.ko"},
		kmodtest.Module{Rel: "kernel/drivers/virtio/virtio_mmio.ko", Depends: []string{"virtio", "virtio_ring"}},
		kmodtest.Module{Rel: "kernel/drivers/virtio/virtio_pci_modern_dev.ko"},
		kmodtest.Module{Rel: "kernel/drivers/virtio/virtio_pci.ko", Depends: []string{"virtio_ring", "virtio_pci_modern_dev", "virtio"}},
		kmodtest.Module{Rel: "kernel/net/vmw_vsock/vsock.ko"},
		kmodtest.Module{Rel: "kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko", Depends: []string{"vsock", "virtio"}},
		kmodtest.Module{Rel: "kernel/net/vmw_vsock/vmw_vsock_virtio_transport.ko", Depends: []string{"virtio", "vmw_vsock_virtio_transport_common", "virtio_ring", "vsock"}},
		kmodtest.Module{Rel: "kernel/net/can/can-raw.ko", Depends: []string{"can"}},
		kmodtest.Module{Rel: "kernel/net/can/can.ko"},
	)
	tr, err := kmod.Open(root)
	if err != nil {
		t.Fatal(err)
	}
	if tr.Release() != release {
		t.Fatalf("Release = %q", tr.Release())
	}
	got, err := tr.Closure("virtio_mmio", "virtio-pci", "vmw_vsock_virtio_transport", "can-raw")
	if err != nil {
		t.Fatal(err)
	}
	want := "virtio virtio_ring virtio_mmio virtio_pci_modern_dev virtio_pci vsock vmw_vsock_virtio_transport_common vmw_vsock_virtio_transport can can_raw"
	if names(got) != want {
		t.Fatalf("order:\n got %s\nwant %s", names(got), want)
	}
	if got[len(got)-1].Rel != "kernel/net/can/can-raw.ko" || got[len(got)-1].File != filepath.Join(root, "kernel/net/can/can-raw.ko") {
		t.Fatalf("can_raw: %+v", got[len(got)-1])
	}
}

func TestClosureErrors(t *testing.T) {
	root := writeTree(t,
		kmodtest.Module{Rel: "kernel/a.ko", Depends: []string{"b"}},
		kmodtest.Module{Rel: "kernel/b.ko", Depends: []string{"a"}},
		kmodtest.Module{Rel: "kernel/c.ko", Depends: []string{"missing"}},
	)
	tr, err := kmod.Open(root)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Closure("a"); err == nil || !strings.Contains(err.Error(), "cycle: a -> b -> a") {
		t.Errorf("cycle: %v", err)
	}
	if _, err := tr.Closure("c"); !errors.Is(err, kmod.ErrUnknownModule) || !strings.Contains(err.Error(), "c -> missing") {
		t.Errorf("missing dependency: %v", err)
	}
	if _, err := tr.Closure("nope"); !errors.Is(err, kmod.ErrUnknownModule) {
		t.Errorf("unknown module: %v", err)
	}
}

func TestBuiltinSkipped(t *testing.T) {
	root := writeTree(t, kmodtest.Module{Rel: "kernel/virtio_blk.ko", Depends: []string{"virtio"}})
	if err := os.WriteFile(filepath.Join(root, "modules.builtin"), []byte("kernel/drivers/virtio/virtio.ko\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	tr, err := kmod.Open(root)
	if err != nil {
		t.Fatal(err)
	}
	got, err := tr.Closure("virtio_blk", "virtio")
	if err != nil {
		t.Fatal(err)
	}
	if names(got) != "virtio_blk" || !tr.Builtin("virtio") {
		t.Fatalf("got %s", names(got))
	}
}

func TestVermagicMismatch(t *testing.T) {
	dir := t.TempDir()
	if _, err := kmodtest.WriteTree(dir, "5.10.0-other", kmodtest.Module{Rel: "kernel/x.ko"}); err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(dir, release)
	if err := os.Rename(filepath.Join(dir, "5.10.0-other"), root); err != nil {
		t.Fatal(err)
	}
	tr, err := kmod.Open(root)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Module("x"); err == nil || !strings.Contains(err.Error(), "vermagic") {
		t.Fatalf("Module with foreign vermagic: %v", err)
	}
}

func TestUpdatesOverrideKernel(t *testing.T) {
	root := writeTree(t, kmodtest.Module{Rel: "kernel/x.ko"}, kmodtest.Module{Rel: "updates/x.ko"})
	tr, err := kmod.Open(root)
	if err != nil {
		t.Fatal(err)
	}
	m, err := tr.Module("x")
	if err != nil || m.Rel != "updates/x.ko" {
		t.Fatalf("Module(x) = %+v, %v", m, err)
	}
	root = writeTree(t, kmodtest.Module{Rel: "kernel/a/x.ko"}, kmodtest.Module{Rel: "kernel/b/x.ko"})
	if _, err := kmod.Open(root); err == nil {
		t.Fatal("ambiguous duplicate accepted")
	}
}

func TestCompressedModules(t *testing.T) {
	root := writeTree(t, kmodtest.Module{Rel: "kernel/plain.ko"})
	image := kmodtest.ELF("name=comp_xz", "depends=plain", "vermagic="+release+" SMP")
	var xzb, gzb bytes.Buffer
	xw, err := xz.NewWriter(&xzb)
	if err != nil {
		t.Fatal(err)
	}
	xw.Write(image)
	if err := xw.Close(); err != nil {
		t.Fatal(err)
	}
	gw := gzip.NewWriter(&gzb)
	gw.Write(bytes.Replace(image, []byte("comp_xz"), []byte("comp_gz"), 1))
	if err := gw.Close(); err != nil {
		t.Fatal(err)
	}
	for name, data := range map[string][]byte{"comp-xz.ko.xz": xzb.Bytes(), "comp_gz.ko.gz": gzb.Bytes(), "comp_zst.ko.zst": []byte("zstd")} {
		if err := os.WriteFile(filepath.Join(root, "kernel", name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	tr, err := kmod.Open(root)
	if err != nil {
		t.Fatal(err)
	}
	got, err := tr.Closure("comp_xz", "comp_gz")
	if err != nil {
		t.Fatal(err)
	}
	if names(got) != "plain comp_xz comp_gz" || got[1].Rel != "kernel/comp-xz.ko" || !strings.HasSuffix(got[1].File, ".ko.xz") {
		t.Fatalf("got %s, %+v", names(got), got[1])
	}
	b, err := kmod.ReadFile(got[1].File)
	if err != nil || !bytes.Equal(b, image) {
		t.Fatalf("ReadFile(xz) = %d bytes, %v", len(b), err)
	}
	if _, err := tr.Module("comp_zst"); !errors.Is(err, kmod.ErrUnsupportedCompression) {
		t.Fatalf("zst: %v", err)
	}
	want, err := os.ReadFile(got[0].File)
	if err != nil {
		t.Fatal(err)
	}
	if b, err := kmod.ReadFile(got[0].File); err != nil || !bytes.Equal(b, want) {
		t.Fatalf("ReadFile(plain) = %d bytes, %v; want %d", len(b), err, len(want))
	}
}

// TestReadFileOneBuffer: a plain module, whose size is known, is read into
// one buffer of that size, not grown into one as io.ReadAll would.
func TestReadFileOneBuffer(t *testing.T) {
	path := filepath.Join(t.TempDir(), "big.ko")
	want := bytes.Repeat([]byte("module!\n"), 1<<17) // 1 MiB
	if err := os.WriteFile(path, want, 0o644); err != nil {
		t.Fatal(err)
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	b, err := kmod.ReadFile(path)
	runtime.ReadMemStats(&after)
	if err != nil || !bytes.Equal(b, want) {
		t.Fatalf("ReadFile = %d bytes, %v; want %d", len(b), err, len(want))
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > uint64(len(want))+64<<10 {
		t.Errorf("ReadFile of %d bytes allocated %d", len(want), alloc)
	}
}

// debianKernel unpacks the last (by name) Debian kernel package in the image cache
// (CARREL_IMAGE_CACHE, else make's /var/cache/carrel; any dev image build
// leaves one in debs/) into a temporary directory and returns its module
// tree. Without one it skips, or fails under CARREL_REQUIRE_VM=1.
func debianKernel(t *testing.T) string {
	t.Helper()
	skip := func(why string) {
		t.Helper()
		if os.Getenv("CARREL_REQUIRE_VM") == "1" {
			t.Fatal(why + "; CARREL_REQUIRE_VM=1 makes that a failure")
		}
		t.Skip(why)
	}
	cache := os.Getenv("CARREL_IMAGE_CACHE")
	if cache == "" {
		cache = "/var/cache/carrel"
	}
	debs, _ := filepath.Glob(filepath.Join(cache, "debs", "linux-image-*.deb"))
	if len(debs) == 0 {
		skip("no linux-image-*.deb in " + filepath.Join(cache, "debs") + ": build a dev image first (make run, or make integration)")
	}
	if _, err := exec.LookPath("dpkg-deb"); err != nil {
		skip("dpkg-deb not found: this test needs a Debian host")
	}
	slices.Sort(debs)
	dir := t.TempDir()
	if out, err := exec.Command("dpkg-deb", "-x", debs[len(debs)-1], dir).CombinedOutput(); err != nil {
		t.Fatalf("unpack %s: %v\n%s", debs[len(debs)-1], err, out)
	}
	matches, _ := filepath.Glob(filepath.Join(dir, "lib", "modules", "*"))
	if len(matches) != 1 {
		t.Fatalf("%s holds %d module trees, want 1: %v", debs[len(debs)-1], len(matches), matches)
	}
	return matches[0]
}

// TestDebianKernel checks the closure against a real unpacked Debian kernel.
func TestDebianKernel(t *testing.T) {
	tr, err := kmod.Open(debianKernel(t))
	if err != nil {
		t.Fatal(err)
	}
	got, err := tr.Closure("virtio_mmio", "virtio_pci", "virtio_console", "virtio_blk", "vsock", "vmw_vsock_virtio_transport")
	if err != nil {
		t.Fatal(err)
	}
	pos := map[string]int{}
	for i, m := range got {
		pos[m.Name] = i
	}
	for _, m := range got {
		for _, d := range m.Depends {
			if tr.Builtin(d) {
				continue
			}
			if p, ok := pos[d]; !ok || p > pos[m.Name] {
				t.Errorf("%s loads before its dependency %s", m.Name, d)
			}
		}
	}
	for _, want := range []string{"virtio", "virtio_ring", "virtio_pci_modern_dev", "virtio_pci_legacy_dev", "vmw_vsock_virtio_transport_common"} {
		if _, ok := pos[want]; !ok {
			t.Errorf("closure lacks %s", want)
		}
	}
	t.Logf("load order: %s", names(got))
}
