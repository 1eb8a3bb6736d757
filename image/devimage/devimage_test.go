package devimage

import (
	"bytes"
	"compress/gzip"
	"context"
	"debug/elf"
	"encoding/binary"
	"errors"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/image/initramfs"
	"github.com/carrel-os/carrel/image/kmod/kmodtest"
	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/image/store"
	"github.com/carrel-os/carrel/image/workspace"
)

const testRelease = "6.1.0-99-amd64"

func quietLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

// fakeAgent writes a minimal static x86-64 ELF executable.
func fakeAgent(t *testing.T, dir string) string {
	t.Helper()
	hdr := elf.Header64{
		Type: uint16(elf.ET_EXEC), Machine: uint16(elf.EM_X86_64), Version: uint32(elf.EV_CURRENT),
		Ehsize: 64, Shentsize: 64,
	}
	copy(hdr.Ident[:], elf.ELFMAG)
	hdr.Ident[elf.EI_CLASS] = byte(elf.ELFCLASS64)
	hdr.Ident[elf.EI_DATA] = byte(elf.ELFDATA2LSB)
	hdr.Ident[elf.EI_VERSION] = byte(elf.EV_CURRENT)
	var b bytes.Buffer
	if err := binary.Write(&b, binary.LittleEndian, hdr); err != nil {
		t.Fatal(err)
	}
	b.WriteString("agent payload")
	p := filepath.Join(dir, "carrel-agent")
	if err := os.WriteFile(p, b.Bytes(), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

// syntheticInputs lays out a fake kernel, module tree and busybox (a shell
// script that prints an applet list, as busybox --list-full does).
func syntheticInputs(t *testing.T) (inputs, string) {
	t.Helper()
	dir := t.TempDir()
	root, err := kmodtest.WriteTree(filepath.Join(dir, "lib/modules"), testRelease,
		kmodtest.Module{Rel: "kernel/drivers/virtio/virtio_ring.ko"},
		kmodtest.Module{Rel: "kernel/drivers/virtio/virtio.ko", Depends: []string{"virtio_ring"}},
		kmodtest.Module{Rel: "kernel/drivers/virtio/virtio_mmio.ko", Depends: []string{"virtio", "virtio_ring"}},
		kmodtest.Module{Rel: "kernel/drivers/virtio/virtio_pci_modern_dev.ko"},
		kmodtest.Module{Rel: "kernel/drivers/virtio/virtio_pci_legacy_dev.ko"},
		kmodtest.Module{Rel: "kernel/drivers/virtio/virtio_pci.ko", Depends: []string{"virtio_ring", "virtio_pci_modern_dev", "virtio_pci_legacy_dev", "virtio"}},
		kmodtest.Module{Rel: "kernel/drivers/char/virtio_console.ko", Depends: []string{"virtio", "virtio_ring"}},
		kmodtest.Module{Rel: "kernel/drivers/block/virtio_blk.ko", Depends: []string{"virtio", "virtio_ring"}},
		kmodtest.Module{Rel: "kernel/crypto/crc32c_generic.ko"},
		kmodtest.Module{Rel: "kernel/lib/crc16.ko"},
		kmodtest.Module{Rel: "kernel/fs/mbcache.ko"},
		kmodtest.Module{Rel: "kernel/fs/jbd2/jbd2.ko"},
		kmodtest.Module{Rel: "kernel/fs/ext4/ext4.ko", Depends: []string{"mbcache", "jbd2", "crc16"}},
		kmodtest.Module{Rel: "kernel/net/vmw_vsock/vsock.ko"},
		kmodtest.Module{Rel: "kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko", Depends: []string{"vsock"}},
		kmodtest.Module{Rel: "kernel/net/vmw_vsock/vmw_vsock_virtio_transport.ko", Depends: []string{"virtio", "vmw_vsock_virtio_transport_common", "virtio_ring", "vsock"}},
		kmodtest.Module{Rel: "kernel/net/can/can.ko"},
	)
	if err != nil {
		t.Fatal(err)
	}
	kernel := filepath.Join(dir, "boot", "vmlinuz-"+testRelease)
	if err := os.MkdirAll(filepath.Dir(kernel), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(kernel, []byte("fake bzImage"), 0o644); err != nil {
		t.Fatal(err)
	}
	busybox := filepath.Join(dir, "bin", "busybox")
	if err := os.MkdirAll(filepath.Dir(busybox), 0o755); err != nil {
		t.Fatal(err)
	}
	script := "#!/bin/sh\n[ \"$1\" = --list-full ] || exit 1\nprintf 'usr/bin/[\\nbin/sh\\nlinuxrc\\nsbin/init\\nusr/bin/head\\nbin/busybox\\nusr/sbin/chroot\\nbin/sh\\n'\n"
	if err := os.WriteFile(busybox, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return inputs{kernel: kernel, moduleRoot: root, busybox: busybox}, fakeAgent(t, dir)
}

func testOptions(t *testing.T, agent string) Options {
	t.Helper()
	o, err := (&Options{CacheDir: t.TempDir(), OutDir: t.TempDir(), AgentBinary: agent, Logger: quietLogger()}).withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	return o
}

func readInitrd(t *testing.T, path string, compressed bool) map[string]initramfs.Entry {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var r io.Reader = f
	if compressed {
		zr, err := gzip.NewReader(f)
		if err != nil {
			t.Fatal(err)
		}
		r = zr
	}
	entries, err := initramfs.Read(r)
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]initramfs.Entry{}
	for _, e := range entries {
		m[e.Name] = e
	}
	return m
}

func TestAssembleLayout(t *testing.T) {
	in, agent := syntheticInputs(t)
	o := testOptions(t, agent)
	res, err := assemble(context.Background(), in, o, execRun)
	if err != nil {
		t.Fatal(err)
	}
	m := res.Manifest
	if m.Name != DefaultName || m.KernelVersion != testRelease || m.Cmdline != DefaultCmdline || m.Arch != "amd64" {
		t.Errorf("manifest %+v", m)
	}
	if m.Kernel.Digest != manifest.DigestBytes([]byte("fake bzImage")) {
		t.Errorf("kernel digest %s", m.Kernel.Digest)
	}
	onDisk, err := os.ReadFile(res.ManifestPath)
	if err != nil {
		t.Fatal(err)
	}
	if d, _ := m.Digest(); manifest.DigestBytes(onDisk) != d {
		t.Error("manifest.json is not the canonical encoding")
	}
	initrd, err := os.ReadFile(res.InitrdPath)
	if err != nil {
		t.Fatal(err)
	}
	if manifest.DigestBytes(initrd) != m.Initrd.Digest || int64(len(initrd)) != m.Initrd.Size {
		t.Error("initrd does not match its manifest part")
	}
	// The workspace template (its content: image/workspace's tests).
	ws, err := os.ReadFile(res.WorkspacePath)
	if err != nil {
		t.Fatal(err)
	}
	if m.Workspace == nil || manifest.DigestBytes(ws) != m.Workspace.Digest || int64(len(ws)) != m.Workspace.Size || m.Workspace.Size != workspace.TemplateSize {
		t.Errorf("workspace template does not match its manifest part %+v", m.Workspace)
	}

	files := readInitrd(t, res.InitrdPath, false)
	agentBytes, _ := os.ReadFile(agent)
	if e := files["init"]; !bytes.Equal(e.Data, agentBytes) || e.Mode != 0o755 {
		t.Errorf("init: mode %v, %d bytes", e.Mode, len(e.Data))
	}
	if e := files["bin/busybox"]; e.Mode != 0o755 || !strings.HasPrefix(string(e.Data), "#!/bin/sh") {
		t.Errorf("bin/busybox: %v", e.Mode)
	}
	for _, ap := range []string{"bin/sh", "sbin/init", "usr/bin/head", "usr/bin/[", "usr/sbin/chroot"} {
		if e := files[ap]; e.Linkname != "/bin/busybox" {
			t.Errorf("%s -> %q", ap, e.Linkname)
		}
	}
	if _, ok := files["linuxrc"]; ok {
		t.Error("linuxrc applet installed")
	}
	for _, d := range []string{"proc", "sys", "dev", "tmp", "run", "workspace", "etc", "root", "home/agent", "usr/bin", "usr/sbin", "sbin", "bin", "var/tmp"} {
		if e, ok := files[d]; !ok || !e.Mode.IsDir() {
			t.Errorf("dir %s missing", d)
		}
	}
	if files["tmp"].Mode != fs.ModeDir|fs.ModeSticky|0o777 || files["home/agent"].UID != 1000 {
		t.Errorf("tmp %v, home/agent uid %d", files["tmp"].Mode, files["home/agent"].UID)
	}
	if c := files["dev/console"]; c.Mode.Type() != fs.ModeDevice|fs.ModeCharDevice || c.Major != 5 || c.Minor != 1 {
		t.Errorf("dev/console %+v", c)
	}
	if !strings.Contains(string(files["etc/passwd"].Data), "agent:x:1000:1000:agent:/home/agent:/bin/sh\n") ||
		string(files["etc/hostname"].Data) != "carrel\n" ||
		!strings.Contains(string(files["etc/os-release"].Data), "ID=carrel") ||
		!strings.Contains(string(files["etc/group"].Data), "agent:x:1000:") {
		t.Error("etc files wrong")
	}

	wantOrder := []string{
		"kernel/drivers/virtio/virtio_ring.ko",
		"kernel/drivers/virtio/virtio.ko",
		"kernel/drivers/virtio/virtio_mmio.ko",
		"kernel/drivers/virtio/virtio_pci_modern_dev.ko",
		"kernel/drivers/virtio/virtio_pci_legacy_dev.ko",
		"kernel/drivers/virtio/virtio_pci.ko",
		"kernel/drivers/char/virtio_console.ko",
		"kernel/drivers/block/virtio_blk.ko",
		"kernel/crypto/crc32c_generic.ko",
		"kernel/fs/mbcache.ko",
		"kernel/fs/jbd2/jbd2.ko",
		"kernel/lib/crc16.ko",
		"kernel/fs/ext4/ext4.ko",
		"kernel/net/vmw_vsock/vsock.ko",
		"kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko",
		"kernel/net/vmw_vsock/vmw_vsock_virtio_transport.ko",
	}
	var want strings.Builder
	for _, p := range wantOrder {
		want.WriteString("/lib/modules/" + testRelease + "/" + p + "\n")
		if _, ok := files["lib/modules/"+testRelease+"/"+p]; !ok {
			t.Errorf("module %s missing", p)
		}
	}
	if got := string(files["etc/carrel/modules"].Data); got != want.String() {
		t.Errorf("etc/carrel/modules:\n%s\nwant:\n%s", got, want.String())
	}
	if _, ok := files["lib/modules/"+testRelease+"/kernel/net/can/can.ko"]; ok {
		t.Error("unrequested module installed")
	}
	if len(res.Modules) != len(wantOrder) {
		t.Errorf("Result.Modules %v", res.Modules)
	}
}

func TestAssembleReproducible(t *testing.T) {
	in, agent := syntheticInputs(t)
	for _, compress := range []bool{false, true} {
		var digests []string
		var initrds [][]byte
		for range 2 {
			o := testOptions(t, agent)
			o.Compress = compress
			res, err := assemble(context.Background(), in, o, execRun)
			if err != nil {
				t.Fatal(err)
			}
			d, err := res.Manifest.Digest()
			if err != nil {
				t.Fatal(err)
			}
			b, err := os.ReadFile(res.InitrdPath)
			if err != nil {
				t.Fatal(err)
			}
			digests = append(digests, d)
			initrds = append(initrds, b)
			if compress {
				readInitrd(t, res.InitrdPath, true)
			}
			time.Sleep(10 * time.Millisecond) // let clocks move; nothing may depend on them
		}
		if digests[0] != digests[1] || !bytes.Equal(initrds[0], initrds[1]) {
			t.Errorf("compress=%v: builds differ: %s vs %s", compress, digests[0], digests[1])
		}
	}
}

func TestAssembleErrors(t *testing.T) {
	in, agent := syntheticInputs(t)
	o := testOptions(t, agent)
	o.Modules = []string{"virtio_blk", "no_such_module"}
	if _, err := assemble(context.Background(), in, o, execRun); err == nil || !strings.Contains(err.Error(), "no_such_module") {
		t.Errorf("unknown module: %v", err)
	}
	o = testOptions(t, agent)
	bad := in
	bad.busybox = "/bin/false"
	if _, err := assemble(context.Background(), bad, o, execRun); err == nil {
		t.Error("failing busybox accepted")
	}
	o.Modules = []string{}
	if res, err := assemble(context.Background(), in, o, execRun); err != nil || len(res.Modules) != 0 {
		t.Errorf("no modules: %v", err)
	}
}

func TestParseApplets(t *testing.T) {
	got, err := parseApplets("usr/bin/[\nbin/sh\nlinuxrc\n../etc/x\nbin/a/b\nbin/\nsbin/init\nbin/busybox\n\n")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(got, " ") != "bin/sh sbin/init usr/bin/[" {
		t.Errorf("got %v", got)
	}
	if _, err := parseApplets("usr/bin/head\n"); err == nil {
		t.Error("applet list without bin/sh accepted")
	}
}

func TestCheckAgent(t *testing.T) {
	dir := t.TempDir()
	if err := checkAgent(fakeAgent(t, dir)); err != nil {
		t.Errorf("static agent rejected: %v", err)
	}
	script := filepath.Join(dir, "script")
	if err := os.WriteFile(script, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := checkAgent(script); err == nil {
		t.Error("shell script accepted as agent")
	}
	if err := checkAgent(filepath.Join(dir, "missing")); err == nil {
		t.Error("missing agent accepted")
	}
	if ls, err := exec.LookPath("ls"); err == nil {
		if f, err := elf.Open(ls); err == nil {
			f.Close()
			if err := checkAgent(ls); err == nil || !strings.Contains(err.Error(), "dynamically linked") {
				t.Errorf("dynamic %s: %v", ls, err)
			}
		}
	}
}

func TestBuildValidatesOptions(t *testing.T) {
	dir := t.TempDir()
	agent := fakeAgent(t, dir)
	for name, o := range map[string]Options{
		"no cache":  {OutDir: dir, AgentBinary: agent},
		"no out":    {CacheDir: dir, AgentBinary: agent},
		"no agent":  {CacheDir: dir, OutDir: dir},
		"bad name":  {CacheDir: dir, OutDir: dir, AgentBinary: agent, Name: "Bad Name"},
		"bad agent": {CacheDir: dir, OutDir: dir, AgentBinary: filepath.Join(dir, "nope")},
	} {
		if _, err := Build(context.Background(), o); err == nil {
			t.Errorf("%s: Build succeeded", name)
		}
	}
}

func TestStoreResult(t *testing.T) {
	in, agent := syntheticInputs(t)
	res, err := assemble(context.Background(), in, testOptions(t, agent), execRun)
	if err != nil {
		t.Fatal(err)
	}
	st, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := StoreResult(st, res, "Bad Tag"); !errors.Is(err, store.ErrInvalidRef) {
		t.Errorf("bad tag: %v", err)
	}
	d, err := StoreResult(st, res, "dev")
	if err != nil {
		t.Fatal(err)
	}
	if want, _ := res.Manifest.Digest(); d != want {
		t.Errorf("digest %s want %s", d, want)
	}
	r, err := st.Verify("dev")
	if err != nil {
		t.Fatal(err)
	}
	if r.Manifest.Initrd != res.Manifest.Initrd || r.WorkspacePath == "" || *r.Manifest.Workspace != *res.Manifest.Workspace {
		t.Errorf("stored manifest %+v, workspace %q", r.Manifest, r.WorkspacePath)
	}

	if err := os.WriteFile(res.KernelPath, []byte("tampered"), 0o644); err != nil {
		t.Fatal(err)
	}
	res.Manifest.Name = "other"
	if _, err := StoreResult(st, res, "other"); err == nil || !strings.Contains(err.Error(), "changed since it was built") {
		t.Errorf("tampered kernel: %v", err)
	}
	if _, err := st.Resolve("other"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("tag created for tampered image: %v", err)
	}
}

// TestBuildDebian does the real download, unpack and build. It needs a
// Debian host with network access to its mirror.
func TestBuildDebian(t *testing.T) {
	if os.Getenv("CARREL_IMAGE_TEST") != "1" {
		t.Skip("set CARREL_IMAGE_TEST=1 to download Debian's kernel and busybox and build a real dev image")
	}
	if _, err := exec.LookPath("apt-get"); err != nil {
		t.Skip("apt-get not found; the dev image builder needs a Debian host")
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "main.go")
	if err := os.WriteFile(src, []byte("package main\nfunc main() { println(\"hello from init\") }\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	agent := filepath.Join(dir, "agent")
	cmd := exec.Command("go", "build", "-o", agent, src)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH=amd64")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build test agent: %v\n%s", err, out)
	}
	cache := os.Getenv("CARREL_IMAGE_CACHE")
	if cache == "" {
		cache = filepath.Join(dir, "cache")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	res, err := Build(ctx, Options{CacheDir: cache, OutDir: filepath.Join(dir, "out"), AgentBinary: agent,
		Logger: slog.New(slog.NewTextHandler(testWriter{t}, nil))})
	if err != nil {
		t.Fatal(err)
	}
	files := readInitrd(t, res.InitrdPath, false)
	for _, p := range res.Modules {
		if _, ok := files[strings.TrimPrefix(p, "/")]; !ok {
			t.Errorf("module %s missing", p)
		}
	}
	if len(res.Modules) < len(DefaultModules) || files["bin/sh"].Linkname != "/bin/busybox" {
		t.Errorf("modules %v", res.Modules)
	}
	t.Logf("kernel %s, initrd %d bytes, modules:\n%s", res.Manifest.KernelVersion, res.Manifest.Initrd.Size, files["etc/carrel/modules"].Data)
}

// TestBuildDebianQemuGA builds the qemu-guest-agent variant for real and
// runs the qemu-ga it installed, through the loader and libraries it
// installed, on the host.
func TestBuildDebianQemuGA(t *testing.T) {
	if os.Getenv("CARREL_IMAGE_TEST") != "1" {
		t.Skip("set CARREL_IMAGE_TEST=1 to download Debian's packages and build a real qemu-guest-agent variant")
	}
	if _, err := exec.LookPath("apt-get"); err != nil {
		t.Skip("apt-get not found; the dev image builder needs a Debian host")
	}
	dir := t.TempDir()
	agent := fakeAgent(t, dir)
	cache := os.Getenv("CARREL_IMAGE_CACHE")
	if cache == "" {
		cache = filepath.Join(dir, "cache")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	res, err := Build(ctx, Options{CacheDir: cache, OutDir: filepath.Join(dir, "out"), AgentBinary: agent, WithQemuGA: true,
		Logger: slog.New(slog.NewTextHandler(testWriter{t}, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if res.QemuGA != QemuGABinary || res.Manifest.Name != QemuGAName {
		t.Fatalf("QemuGA %q, name %q", res.QemuGA, res.Manifest.Name)
	}
	files := readInitrd(t, res.InitrdPath, false)
	root := filepath.Join(dir, "root")
	var loader string
	for _, p := range append([]string{res.QemuGA}, res.QemuGALibs...) {
		e, ok := files[strings.TrimPrefix(p, "/")]
		if !ok || !e.Mode.IsRegular() {
			t.Fatalf("%s missing from the initramfs", p)
		}
		dst := filepath.Join(root, p)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(dst, e.Data, 0o755); err != nil {
			t.Fatal(err)
		}
		if strings.Contains(p, "ld-linux") {
			loader = dst
		}
	}
	if files["var/run"].Linkname != "/run" {
		t.Errorf("var/run: %+v", files["var/run"])
	}
	// The image's loader with only the image's libraries must run it.
	out, err := exec.Command(loader, "--inhibit-cache", "--library-path", filepath.Join(root, guestLibDir),
		filepath.Join(root, QemuGABinary), "--version").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "QEMU Guest Agent") {
		t.Fatalf("qemu-ga --version: %v\n%s", err, out)
	}
	t.Logf("%s; libraries %v", strings.TrimSpace(string(out)), res.QemuGALibs)
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// TestResolveDynamic resolves a dynamically linked host program against
// the host's library directories, and fails clearly where they lack one.
func TestResolveDynamic(t *testing.T) {
	bin, err := exec.LookPath("ls")
	if err != nil {
		t.Skip("no ls on PATH")
	}
	d, err := resolveDynamic(bin, DefaultLibDirs)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) || strings.Contains(err.Error(), "want x86-64") {
			t.Skipf("not an x86-64 Debian host: %v", err)
		}
		t.Fatal(err)
	}
	if d.interp == nil {
		t.Skipf("%s is static", bin)
	}
	if d.interp.guest != "lib64/ld-linux-x86-64.so.2" {
		t.Errorf("loader at %s", d.interp.guest)
	}
	var libc bool
	for _, l := range d.libs {
		if !strings.HasPrefix(l.guest, guestLibDir+"/") || !filepath.IsAbs(l.src) {
			t.Errorf("library %+v", l)
		}
		libc = libc || l.guest == guestLibDir+"/libc.so.6"
	}
	if !libc {
		t.Errorf("libc.so.6 not among %+v", d.libs)
	}
	if _, err := resolveDynamic(bin, []string{t.TempDir()}); err == nil || !strings.Contains(err.Error(), "no x86-64") {
		t.Errorf("empty library dir: %v", err)
	}
	// A static executable needs nothing.
	d, err = resolveDynamic(fakeAgent(t, t.TempDir()), nil)
	if err != nil || d.interp != nil || len(d.libs) != 0 {
		t.Errorf("static: %+v, %v", d, err)
	}
}

// TestAssembleQemuGA lays out the qemu-guest-agent variant from synthetic
// inputs: qemu-ga, its loader at the PT_INTERP path, its libraries in the
// loader's default directory, and /var/run.
func TestAssembleQemuGA(t *testing.T) {
	in, agent := syntheticInputs(t)
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	in.qemuGA = &dynamicBinary{
		binary: write("qemu-ga", "qga"),
		interp: &sharedObject{guest: "lib64/ld-linux-x86-64.so.2", src: write("ld.so", "loader")},
		libs: []sharedObject{
			{guest: guestLibDir + "/libglib-2.0.so.0", src: write("glib", "glib")},
			{guest: guestLibDir + "/libc.so.6", src: write("libc", "libc")},
		},
	}
	o, err := (&Options{CacheDir: t.TempDir(), OutDir: t.TempDir(), AgentBinary: agent, WithQemuGA: true, Logger: quietLogger()}).withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	res, err := assemble(context.Background(), in, o, execRun)
	if err != nil {
		t.Fatal(err)
	}
	if res.Manifest.Name != QemuGAName || res.QemuGA != QemuGABinary {
		t.Errorf("name %q, QemuGA %q", res.Manifest.Name, res.QemuGA)
	}
	want := map[string]string{
		"usr/sbin/qemu-ga":                          "qga",
		"lib64/ld-linux-x86-64.so.2":                "loader",
		"usr/lib/x86_64-linux-gnu/libglib-2.0.so.0": "glib",
		"usr/lib/x86_64-linux-gnu/libc.so.6":        "libc",
	}
	files := readInitrd(t, res.InitrdPath, false)
	for p, content := range want {
		if e := files[p]; string(e.Data) != content || e.Mode.Perm()&0o444 != 0o444 {
			t.Errorf("%s: %q, mode %v", p, e.Data, e.Mode)
		}
	}
	if files["usr/sbin/qemu-ga"].Mode != 0o755 || files["var/run"].Linkname != "/run" {
		t.Errorf("qemu-ga mode %v, var/run %+v", files["usr/sbin/qemu-ga"].Mode, files["var/run"])
	}
	if len(res.QemuGALibs) != 3 || res.QemuGALibs[0] != "/lib64/ld-linux-x86-64.so.2" {
		t.Errorf("QemuGALibs %v", res.QemuGALibs)
	}
	// The plain image has none of it.
	plain, err := assemble(context.Background(), inputs{kernel: in.kernel, moduleRoot: in.moduleRoot, busybox: in.busybox}, testOptions(t, agent), execRun)
	if err != nil {
		t.Fatal(err)
	}
	files = readInitrd(t, plain.InitrdPath, false)
	if _, ok := files["usr/sbin/qemu-ga"]; ok || plain.QemuGA != "" {
		t.Error("qemu-ga in the plain image")
	}
	if _, ok := files["var/run"]; ok {
		t.Error("var/run in the plain image")
	}
}
