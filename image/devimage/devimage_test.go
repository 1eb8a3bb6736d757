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
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/carrel-os/carrel/image/imagedir"
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
		kmodtest.Module{Rel: "kernel/drivers/md/dm-mod.ko"},
		kmodtest.Module{Rel: "kernel/drivers/md/dm-bufio.ko"},
		kmodtest.Module{Rel: "kernel/drivers/md/dm-verity.ko", Depends: []string{"dm-bufio", "dm-mod"}},
		kmodtest.Module{Rel: "kernel/fs/erofs/erofs.ko"},
		kmodtest.Module{Rel: "kernel/fs/overlayfs/overlay.ko"},
		kmodtest.Module{Rel: "kernel/arch/x86/crypto/sha256-ssse3.ko"},
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

// needAssembleTools skips a test that assembles an image where the host
// cannot: the root file system is made with mkfs.erofs and the workspace
// template with mkfs.ext4, and laying the root out with its owners takes
// root.
func needAssembleTools(t *testing.T) {
	t.Helper()
	for _, tool := range []string{"mkfs.erofs", "mkfs.ext4"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not found (erofs-utils, e2fsprogs): run `make deps`", tool)
		}
	}
	if os.Getuid() != 0 {
		t.Skip("not root: the image's root file system holds files of other owners")
	}
}

func testOptions(t *testing.T, agent string) Options {
	t.Helper()
	needAssembleTools(t)
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

// extractRoot unpacks the image's root file system with fsck.erofs, which
// also checks it, keeping owners and modes, and returns the directory.
func extractRoot(t *testing.T, res *Result) string {
	t.Helper()
	fsck, err := exec.LookPath("fsck.erofs")
	if err != nil {
		t.Skip("fsck.erofs not found (erofs-utils): cannot look inside the root file system")
	}
	dir := filepath.Join(t.TempDir(), "root")
	if out, err := exec.Command(fsck, "--extract="+dir, "--preserve", res.SystemPath).CombinedOutput(); err != nil {
		t.Fatalf("fsck.erofs --extract: %v\n%s", err, out)
	}
	return dir
}

// rootFile is one file of an extracted root.
type rootFile struct {
	mode     fs.FileMode
	uid, gid uint32
	data     []byte
	link     string
}

func statRoot(t *testing.T, root, name string) (rootFile, bool) {
	t.Helper()
	p := filepath.Join(root, filepath.FromSlash(name))
	fi, err := os.Lstat(p)
	if errors.Is(err, fs.ErrNotExist) {
		return rootFile{}, false
	}
	if err != nil {
		t.Fatal(err)
	}
	st := fi.Sys().(*syscall.Stat_t)
	f := rootFile{mode: fi.Mode(), uid: st.Uid, gid: st.Gid}
	switch {
	case fi.Mode().IsRegular():
		if f.data, err = os.ReadFile(p); err != nil {
			t.Fatal(err)
		}
	case fi.Mode()&fs.ModeSymlink != 0:
		if f.link, err = os.Readlink(p); err != nil {
			t.Fatal(err)
		}
	}
	return f, true
}

func TestAssembleLayout(t *testing.T) {
	in, agent := syntheticInputs(t)
	o := testOptions(t, agent)
	res, err := assemble(context.Background(), in, o, execRun)
	if err != nil {
		t.Fatal(err)
	}
	m := res.Manifest
	if m.Name != DefaultName || m.KernelVersion != testRelease || m.Arch != "amd64" {
		t.Errorf("manifest %+v", m)
	}
	if m.System == nil || m.SystemVerity == nil || m.Verity == nil {
		t.Fatalf("no verified root in the manifest %+v", m)
	}
	if want := DefaultCmdline + " roothash=" + m.Verity.RootHash + " "; !strings.HasPrefix(m.Cmdline, want) {
		t.Errorf("cmdline %q, want it to start %q", m.Cmdline, want)
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
	// The output is exactly an image directory, every part as the manifest
	// says, the root's hash tree included; nothing else is left in it.
	d, err := imagedir.Check(o.OutDir)
	if err != nil {
		t.Fatal(err)
	}
	for part, p := range map[string]string{
		manifest.PartKernel: res.KernelPath, manifest.PartInitrd: res.InitrdPath, manifest.PartWorkspace: res.WorkspacePath,
		manifest.PartSystem: res.SystemPath, manifest.PartSystemVerity: res.SystemVerityPath,
	} {
		if f, ok := d.File(part); !ok || f.Path != p {
			t.Errorf("Result names %s for the %s, the image directory %+v", p, part, f)
		}
	}
	if m.Workspace.Size != workspace.TemplateSize {
		t.Errorf("workspace template %+v (its content: image/workspace's tests)", m.Workspace)
	}

	// The initramfs: the agent as /init, the console, the modules and
	// their list, and nothing else.
	files := readInitrd(t, res.InitrdPath, false)
	agentBytes, _ := os.ReadFile(agent)
	if e := files["init"]; !bytes.Equal(e.Data, agentBytes) || e.Mode != 0o755 || e.UID != 0 {
		t.Errorf("init: mode %v, uid %d, %d bytes", e.Mode, e.UID, len(e.Data))
	}
	if c := files["dev/console"]; c.Mode.Type() != fs.ModeDevice|fs.ModeCharDevice || c.Major != 5 || c.Minor != 1 {
		t.Errorf("dev/console %+v", c)
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
		"kernel/drivers/md/dm-bufio.ko",
		"kernel/drivers/md/dm-mod.ko",
		"kernel/drivers/md/dm-verity.ko",
		"kernel/fs/erofs/erofs.ko",
		"kernel/fs/overlayfs/overlay.ko",
		"kernel/arch/x86/crypto/sha256-ssse3.ko",
	}
	var want strings.Builder
	for _, p := range wantOrder {
		want.WriteString("/lib/modules/" + testRelease + "/" + p + "\n")
		if e, ok := files["lib/modules/"+testRelease+"/"+p]; !ok || e.Mode != 0o644 {
			t.Errorf("module %s: %+v", p, e)
		}
	}
	if e := files["etc/carrel/modules"]; string(e.Data) != want.String() || e.Mode != 0o644 {
		t.Errorf("etc/carrel/modules (%v):\n%s\nwant:\n%s", e.Mode, e.Data, want.String())
	}
	if _, ok := files["lib/modules/"+testRelease+"/kernel/net/can/can.ko"]; ok {
		t.Error("unrequested module installed")
	}
	if len(res.Modules) != len(wantOrder) {
		t.Errorf("Result.Modules %v", res.Modules)
	}
	initrdOnly := map[string]bool{"init": true, "dev": true, "dev/console": true, "proc": true, "sys": true, "run": true,
		"etc": true, "etc/carrel": true, "etc/carrel/modules": true, "lib": true, "lib/modules": true}
	for name := range files {
		if !initrdOnly[name] && !strings.HasPrefix(name, "lib/modules/"+testRelease) {
			t.Errorf("the initramfs holds %s, which belongs in the root", name)
		}
	}

	// The root file system: busybox and its applets, the accounts, the
	// directories with their modes and owners, the canary.
	root := extractRoot(t, res)
	file := func(name string) rootFile {
		t.Helper()
		f, ok := statRoot(t, root, name)
		if !ok {
			t.Errorf("%s is not in the root", name)
		}
		return f
	}
	if f := file("bin/busybox"); f.mode != 0o755 || f.uid != 0 || !strings.HasPrefix(string(f.data), "#!/bin/sh") {
		t.Errorf("bin/busybox: %v, uid %d", f.mode, f.uid)
	}
	for _, ap := range []string{"bin/sh", "sbin/init", "usr/bin/head", "usr/bin/[", "usr/sbin/chroot"} {
		if f := file(ap); f.mode.Type() != fs.ModeSymlink || f.link != "/bin/busybox" {
			t.Errorf("%s: %v -> %q", ap, f.mode, f.link)
		}
	}
	for _, absent := range []string{"linuxrc", "init", "var/run", "usr/sbin/qemu-ga"} {
		if _, ok := statRoot(t, root, absent); ok {
			t.Errorf("%s is in the root", absent)
		}
	}
	for _, d := range guestDirs {
		if f := file(d.name); f.mode != fs.ModeDir|d.mode || f.uid != 0 || f.gid != 0 {
			t.Errorf("%s: %v %d:%d, want %v root's", d.name, f.mode, f.uid, f.gid, fs.ModeDir|d.mode)
		}
	}
	for _, d := range []string{"home/agent", "workspace"} {
		if f := file(d); f.mode != fs.ModeDir|0o755 || f.uid != 1000 || f.gid != 1000 {
			t.Errorf("%s: %v %d:%d, want the agent's", d, f.mode, f.uid, f.gid)
		}
	}
	if f := file("tmp"); f.mode != fs.ModeDir|fs.ModeSticky|0o777 {
		t.Errorf("tmp: %v", f.mode)
	}
	etc := map[string]string{
		"etc/passwd":     "agent:x:1000:1000:agent:/home/agent:/bin/sh\n",
		"etc/group":      "agent:x:1000:\n",
		"etc/hostname":   "carrel\n",
		"etc/os-release": "ID=carrel\n",
	}
	for name, line := range etc {
		if f := file(name); f.mode != 0o644 || f.uid != 0 || !strings.Contains(string(f.data), line) {
			t.Errorf("%s (%v, uid %d): %q, want a line %q", name, f.mode, f.uid, f.data, line)
		}
	}
	if f := file(CanaryPath); !bytes.Equal(f.data, Canary()) || f.mode != 0o644 {
		t.Errorf("%s: %v, %d bytes, not the canary", CanaryPath, f.mode, len(f.data))
	}
}

// TestAssembleReproducible assembles twice from the same inputs into
// different output directories, a moment apart: every file must be the
// same, byte for byte, and so the manifest digest.
func TestAssembleReproducible(t *testing.T) {
	in, agent := syntheticInputs(t)
	names := []string{imagedir.ManifestFile}
	for _, part := range []string{manifest.PartKernel, manifest.PartInitrd, manifest.PartWorkspace, manifest.PartSystem, manifest.PartSystemVerity} {
		names = append(names, imagedir.FileName(part))
	}
	for _, compress := range []bool{false, true} {
		var digests []string
		var outs []string
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
			digests = append(digests, d)
			outs = append(outs, o.OutDir)
			if compress {
				readInitrd(t, res.InitrdPath, true)
			}
			if len(outs) == 1 {
				time.Sleep(1100 * time.Millisecond) // let clocks pass a second; nothing may depend on them
			}
		}
		if outs[0] == outs[1] {
			t.Fatal("both builds went to one directory")
		}
		if digests[0] != digests[1] {
			t.Errorf("compress=%v: manifest digests differ: %s vs %s", compress, digests[0], digests[1])
		}
		for _, name := range names {
			a, err := os.ReadFile(filepath.Join(outs[0], name))
			if err != nil {
				t.Fatal(err)
			}
			b, err := os.ReadFile(filepath.Join(outs[1], name))
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(a, b) {
				t.Errorf("compress=%v: %s differs between the builds", compress, name)
			}
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

// TestImportAssembled imports an assembled image with store.Import, as
// `carrel image build-dev` does, and then a copy whose kernel was changed
// after the build: that import must fail and leave the store as it was.
func TestImportAssembled(t *testing.T) {
	in, agent := syntheticInputs(t)
	o := testOptions(t, agent)
	res, err := assemble(context.Background(), in, o, execRun)
	if err != nil {
		t.Fatal(err)
	}
	st, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	imp, err := st.Import(o.OutDir, "dev")
	if err != nil {
		t.Fatal(err)
	}
	if want, _ := res.Manifest.Digest(); imp.Digest != want || imp.Already {
		t.Errorf("Import = %+v, want digest %s", imp, want)
	}
	r, err := st.Verify("dev")
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(r.Manifest, res.Manifest) || r.WorkspacePath == "" || r.SystemPath == "" || r.SystemVerityPath == "" {
		t.Errorf("stored %+v", r)
	}
	if err := imagedir.VerifySystem(r.Manifest, r.SystemPath, r.SystemVerityPath); err != nil {
		t.Errorf("stored root: %v", err)
	}

	kernel, err := os.ReadFile(res.KernelPath)
	if err != nil {
		t.Fatal(err)
	}
	for name, tampered := range map[string][]byte{
		"same size":  append([]byte("X"), kernel[1:]...),
		"other size": []byte("tampered"),
	} {
		t.Run(name, func(t *testing.T) {
			// A copy of the image, under another name so that it is a
			// new image to the store, with its kernel rewritten.
			dir := t.TempDir()
			for _, n := range []string{"vmlinuz", "initrd.img", "workspace.img", "system.erofs", "system.verity"} {
				copyFile(t, filepath.Join(o.OutDir, n), filepath.Join(dir, n))
			}
			m := *res.Manifest
			m.Name = "tampered"
			b, err := m.Marshal()
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, imagedir.ManifestFile), b, 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, imagedir.FileName(manifest.PartKernel)), tampered, 0o644); err != nil {
				t.Fatal(err)
			}
			before, err := st.List()
			if err != nil {
				t.Fatal(err)
			}
			blobs := readDirNames(t, filepath.Join(st.Dir(), "blobs/sha256"))
			_, err = st.Import(dir, "tampered")
			if !errors.Is(err, imagedir.ErrInvalid) || !strings.Contains(err.Error(), "vmlinuz") {
				t.Fatalf("Import of a changed kernel: %v", err)
			}
			if after, err := st.List(); err != nil || !reflect.DeepEqual(after, before) {
				t.Errorf("List changed: %+v, %v; was %+v", after, err, before)
			}
			if _, err := st.Resolve("tampered"); !errors.Is(err, store.ErrNotFound) {
				t.Errorf("tag created for a tampered image: %v", err)
			}
			if got := readDirNames(t, filepath.Join(st.Dir(), "blobs/sha256")); !reflect.DeepEqual(got, blobs) {
				t.Errorf("blobs %v, were %v", got, blobs)
			}
			if tmp := readDirNames(t, filepath.Join(st.Dir(), "tmp")); len(tmp) != 0 {
				t.Errorf("tmp holds %v", tmp)
			}
		})
	}
}

func copyFile(t *testing.T, src, dst string) {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dst, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func readDirNames(t *testing.T, dir string) []string {
	t.Helper()
	des, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	names := []string{}
	for _, de := range des {
		names = append(names, de.Name())
	}
	return names
}

// needImageTest skips a test that builds a real image (what it does is
// what), unless CARREL_IMAGE_TEST=1 asks for it and the host has apt-get.
// Under CARREL_REQUIRE_VM=1 it fails instead. make integration sets both
// for TestBuildDebian and TestBuildDebianQemuGA, which need no network once
// the cache holds the kernel, busybox and qemu-guest-agent (tests/qga then
// runs the qemu-ga the latter left unpacked there).
func needImageTest(t *testing.T, what string) {
	t.Helper()
	skip := func(why string) {
		t.Helper()
		if os.Getenv("CARREL_REQUIRE_VM") == "1" {
			t.Fatal(why + "; CARREL_REQUIRE_VM=1 makes that a failure")
		}
		t.Skip(why)
	}
	if os.Getenv("CARREL_IMAGE_TEST") != "1" {
		skip("CARREL_IMAGE_TEST=1 is not set: it would " + what)
	}
	if _, err := exec.LookPath("apt-get"); err != nil {
		skip("apt-get not found; the dev image builder needs a Debian host")
	}
}

// TestBuildDebian does the real download, unpack and build. It needs a
// Debian host with network access to its mirror.
func TestBuildDebian(t *testing.T) {
	needImageTest(t, "download Debian's kernel and busybox and build a real dev image")
	needAssembleTools(t)
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
	out := filepath.Join(dir, "out")
	res, err := Build(ctx, Options{CacheDir: cache, OutDir: out, AgentBinary: agent,
		Logger: slog.New(slog.NewTextHandler(testWriter{t}, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := imagedir.Check(out); err != nil {
		t.Fatal(err)
	}
	files := readInitrd(t, res.InitrdPath, false)
	for _, p := range res.Modules {
		if _, ok := files[strings.TrimPrefix(p, "/")]; !ok {
			t.Errorf("module %s missing", p)
		}
	}
	if len(res.Modules) < len(DefaultModules) {
		t.Errorf("modules %v", res.Modules)
	}
	root := extractRoot(t, res)
	if f, ok := statRoot(t, root, "bin/sh"); !ok || f.link != "/bin/busybox" {
		t.Errorf("bin/sh: %+v", f)
	}
	if len(res.Manifest.Packages) < 2 {
		t.Errorf("packages %v", res.Manifest.Packages)
	}
	t.Logf("kernel %s, initrd %d bytes, root %d bytes, modules:\n%s", res.Manifest.KernelVersion,
		res.Manifest.Initrd.Size, res.Manifest.System.Size, files["etc/carrel/modules"].Data)
}

// TestBuildDebianQemuGA builds the qemu-guest-agent variant for real and
// runs the qemu-ga it installed, through the loader and libraries it
// installed, on the host.
func TestBuildDebianQemuGA(t *testing.T) {
	needImageTest(t, "download Debian's packages and build a real qemu-guest-agent variant")
	needAssembleTools(t)
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
	root := extractRoot(t, res)
	var loader string
	for _, p := range append([]string{res.QemuGA}, res.QemuGALibs...) {
		f, ok := statRoot(t, root, p)
		if !ok || !f.mode.IsRegular() {
			t.Fatalf("%s missing from the root", p)
		}
		if strings.Contains(p, "ld-linux") {
			loader = filepath.Join(root, p)
		}
	}
	if f, _ := statRoot(t, root, "var/run"); f.link != "/run" {
		t.Errorf("var/run: %+v", f)
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
// loader's default directory, and /var/run, all in the root file system.
func TestAssembleQemuGA(t *testing.T) {
	needAssembleTools(t)
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
	root := extractRoot(t, res)
	for p, content := range want {
		if f, ok := statRoot(t, root, p); !ok || string(f.data) != content || f.mode.Perm()&0o444 != 0o444 || f.uid != 0 {
			t.Errorf("%s: %q, mode %v, uid %d", p, f.data, f.mode, f.uid)
		}
	}
	qga, _ := statRoot(t, root, "usr/sbin/qemu-ga")
	run, _ := statRoot(t, root, "var/run")
	if qga.mode != 0o755 || run.link != "/run" {
		t.Errorf("qemu-ga mode %v, var/run %+v", qga.mode, run)
	}
	if len(res.QemuGALibs) != 3 || res.QemuGALibs[0] != "/lib64/ld-linux-x86-64.so.2" {
		t.Errorf("QemuGALibs %v", res.QemuGALibs)
	}
	// None of it is in the initramfs.
	for name := range readInitrd(t, res.InitrdPath, false) {
		if _, ok := want[name]; ok || name == "var/run" {
			t.Errorf("%s in the initramfs", name)
		}
	}
	// The plain image has none of it.
	plain, err := assemble(context.Background(), inputs{kernel: in.kernel, moduleRoot: in.moduleRoot, busybox: in.busybox}, testOptions(t, agent), execRun)
	if err != nil {
		t.Fatal(err)
	}
	root = extractRoot(t, plain)
	for _, p := range append([]string{"usr/sbin/qemu-ga", "var/run", "lib64"}, guestLibDir+"/libc.so.6") {
		if _, ok := statRoot(t, root, p); ok {
			t.Errorf("%s in the plain image", p)
		}
	}
	if plain.QemuGA != "" || len(plain.QemuGALibs) != 0 {
		t.Errorf("plain image: QemuGA %q, libs %v", plain.QemuGA, plain.QemuGALibs)
	}
}
