package devimage

import (
	"bufio"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/carrel-os/carrel/image/erofs"
	"github.com/carrel-os/carrel/image/imagedir"
	"github.com/carrel-os/carrel/image/initramfs"
	"github.com/carrel-os/carrel/image/kmod"
	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/image/pack"
)

// Guest paths and accounts the agent relies on.
const (
	guestModuleList = "etc/carrel/modules"
	agentUID        = 1000
)

// guestDirs are created in every image, with their modes. /tmp and /var/tmp
// are world-writable with the sticky bit; /root is private.
var guestDirs = []struct {
	name string
	mode fs.FileMode
}{
	{"bin", 0o755}, {"sbin", 0o755}, {"usr/bin", 0o755}, {"usr/sbin", 0o755},
	{"dev", 0o755}, {"proc", 0o555}, {"sys", 0o555}, {"run", 0o755},
	{"tmp", 0o777 | fs.ModeSticky}, {"var/tmp", 0o777 | fs.ModeSticky},
	{"etc", 0o755}, {"etc/carrel", 0o755}, {"root", 0o700}, {"home", 0o755},
	{"lib", 0o755}, {"var", 0o755}, {"mnt", 0o755},
}

// agentDirs belong to the unprivileged user commands run as.
var agentDirs = []string{"home/agent", "workspace"}

// assemble writes the kernel, the initramfs, the verified root (erofs and
// its dm-verity hash device), the workspace template and the manifest to
// o.OutDir, under the names of carrel's image directory (image/imagedir).
// The initramfs holds only carrel-agent, as /init, and the modules it
// loads to reach the root; everything else is in the root.
func assemble(ctx context.Context, in inputs, o Options, run runFunc) (*Result, error) {
	start := time.Now()
	tree, err := kmod.Open(in.moduleRoot)
	if err != nil {
		return nil, err
	}
	for _, m := range o.Modules {
		if tree.Builtin(m) {
			o.Logger.Info("module is built into the kernel; not loading it", "module", m)
		}
	}
	mods, err := tree.Closure(o.Modules...)
	if err != nil {
		return nil, err
	}
	initrdTree, guestMods, err := buildInitrd(o, tree.Release(), mods)
	if err != nil {
		return nil, err
	}
	// The dev image's root is laid out here; a builder such as
	// image/debian brings its own (Options.RootTree).
	var rootTree *initramfs.Archive
	if o.RootTree == "" {
		applets, err := busyboxApplets(ctx, run, in.busybox)
		if err != nil {
			return nil, err
		}
		if rootTree, err = buildRoot(o, tree.Release(), applets, in); err != nil {
			return nil, err
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}

	if err := os.MkdirAll(o.OutDir, 0o755); err != nil {
		return nil, fmt.Errorf("create output dir: %w", err)
	}
	file := func(part string) string { return filepath.Join(o.OutDir, imagedir.FileName(part)) }
	res := &Result{
		KernelPath:       file(manifest.PartKernel),
		InitrdPath:       file(manifest.PartInitrd),
		SystemPath:       file(manifest.PartSystem),
		SystemVerityPath: file(manifest.PartSystemVerity),
		WorkspacePath:    file(manifest.PartWorkspace),
		ManifestPath:     filepath.Join(o.OutDir, imagedir.ManifestFile),
		Modules:          guestMods,
	}
	if in.qemuGA != nil {
		res.QemuGA = QemuGABinary
		if in.qemuGA.interp != nil {
			res.QemuGALibs = append(res.QemuGALibs, "/"+in.qemuGA.interp.guest)
		}
		for _, l := range in.qemuGA.libs {
			res.QemuGALibs = append(res.QemuGALibs, "/"+l.guest)
		}
	}
	// The initramfs and the dev image's root are laid out in a scratch
	// directory beside the output; image/pack makes the image of them.
	scratch, err := os.MkdirTemp(o.OutDir, ".assemble-*")
	if err != nil {
		return nil, fmt.Errorf("scratch dir: %w", err)
	}
	defer os.RemoveAll(scratch)
	initrdPath := filepath.Join(scratch, "initrd")
	if err := writeInitrd(initrdPath, initrdTree, o.Compress); err != nil {
		return nil, fmt.Errorf("write initramfs: %w", err)
	}
	system := o.RootTree
	if system == "" {
		system = filepath.Join(scratch, "root")
		if err := rootTree.WriteDir(system); err != nil {
			return nil, fmt.Errorf("lay out root: %w", err)
		}
	}
	m, err := pack.Pack(ctx, o.OutDir, pack.Parts{
		Name:          o.Name,
		KernelVersion: tree.Release(),
		Kernel:        in.kernel,
		Initrd:        initrdPath,
		System:        system,
		Erofs:         erofs.Options{Compressor: o.RootCompressor},
		Mount:         manifest.MountRoot,
		Cmdline:       o.Cmdline,
		Packages:      in.packages,
	})
	if err != nil {
		return nil, err
	}
	res.Manifest = m
	b, err := m.Marshal()
	if err != nil {
		return nil, err
	}
	o.Logger.Info("built image", "name", o.Name, "dir", o.OutDir, "release", tree.Release(),
		"modules", len(guestMods), "packages", len(m.Packages),
		"initrd_bytes", m.Initrd.Size, "root_bytes", m.System.Size, "root_hash", m.Verity.RootHash,
		"compressed", o.Compress,
		"digest", manifest.DigestBytes(b), "assemble_time", time.Since(start).Round(time.Millisecond))
	return res, nil
}

// writeInitrd writes the initramfs archive to path, gzipped when compress
// is set. A zero gzip header (no name, no mtime) keeps the output
// reproducible for a given Go release.
func writeInitrd(path string, a *initramfs.Archive, compress bool) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	bw := bufio.NewWriterSize(f, 1<<20)
	if compress {
		zw, err := gzip.NewWriterLevel(bw, gzip.BestCompression)
		if err != nil {
			return err
		}
		if _, err := a.WriteTo(zw); err != nil {
			return err
		}
		if err := zw.Close(); err != nil {
			return err
		}
	} else if _, err := a.WriteTo(bw); err != nil {
		return err
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	return f.Close()
}

// busyboxApplets lists the applet links busybox wants, keeping only those in
// the four bin directories (its list also has "linuxrc", which must not
// shadow /init).
func busyboxApplets(ctx context.Context, run runFunc, busybox string) ([]string, error) {
	out, err := run(ctx, filepath.Dir(busybox), busybox, "--list-full")
	if err != nil {
		return nil, fmt.Errorf("list busybox applets: %w", err)
	}
	applets, err := parseApplets(string(out))
	if err != nil {
		return nil, fmt.Errorf("list busybox applets: %w", err)
	}
	return applets, nil
}

func parseApplets(out string) ([]string, error) {
	var applets []string
	for _, line := range strings.Split(out, "\n") {
		line = strings.TrimSpace(line)
		dir, base := path.Split(line)
		switch {
		case line == "" || line == "bin/busybox":
		case dir != "bin/" && dir != "sbin/" && dir != "usr/bin/" && dir != "usr/sbin/":
		case base == "" || base == "." || base == "..":
		default:
			applets = append(applets, line)
		}
	}
	slices.Sort(applets)
	applets = slices.Compact(applets)
	if !slices.Contains(applets, "bin/sh") {
		return nil, errors.New("busybox provides no bin/sh applet")
	}
	return applets, nil
}

// buildInitrd lays out the initramfs: carrel-agent as /init, the modules
// it loads before it mounts the root, and their list. It returns the
// modules' guest paths in load order.
func buildInitrd(o Options, release string, mods []*kmod.Module) (*initramfs.Archive, []string, error) {
	a := initramfs.New()
	var errs []error
	for _, d := range []string{"dev", "proc", "sys", "run", "etc/carrel"} {
		errs = append(errs, a.Dir(d, 0o755))
	}
	// The kernel opens /dev/console for /init's stdio before anything can
	// mount devtmpfs.
	errs = append(errs, a.CharDev("dev/console", 0o600, 5, 1))
	errs = append(errs, a.FileFrom("init", 0o755, o.AgentBinary))
	var guestMods []string
	modRoot := path.Join("lib/modules", release)
	for _, m := range mods {
		data, err := kmod.ReadFile(m.File)
		if err != nil {
			return nil, nil, err
		}
		p := path.Join(modRoot, m.Rel)
		errs = append(errs, a.File(p, 0o644, data))
		guestMods = append(guestMods, "/"+p)
	}
	var list strings.Builder
	for _, p := range guestMods {
		list.WriteString(p + "\n")
	}
	errs = append(errs, a.File(guestModuleList, 0o644, []byte(list.String())))
	if err := errors.Join(errs...); err != nil {
		return nil, nil, fmt.Errorf("lay out initramfs: %w", err)
	}
	return a, guestMods, nil
}

// buildRoot lays out the root file system: busybox and its applets, the
// accounts, and qemu-ga in its variant.
func buildRoot(o Options, release string, applets []string, in inputs) (*initramfs.Archive, error) {
	a := initramfs.New()
	var errs []error
	for _, d := range guestDirs {
		errs = append(errs, a.Dir(d.name, d.mode))
	}
	for _, d := range agentDirs {
		errs = append(errs, a.Add(initramfs.Entry{Name: d, Mode: fs.ModeDir | 0o755, UID: agentUID, GID: agentUID}))
	}
	errs = append(errs, a.FileFrom("bin/busybox", 0o755, in.busybox))
	errs = append(errs, a.File(CanaryPath[1:], 0o644, Canary()))
	if in.qemuGA != nil {
		// qemu-ga keeps its state in /var/run unless told otherwise; Debian
		// links it to /run, a tmpfs the agent mounts.
		errs = append(errs, a.Symlink("var/run", "/run"))
		errs = append(errs, addDynamic(a.FileFrom, QemuGABinary, in.qemuGA)...)
	}
	for _, ap := range applets {
		if !a.Has(ap) {
			errs = append(errs, a.Symlink(ap, "/bin/busybox"))
		}
	}
	errs = append(errs,
		a.File("etc/passwd", 0o644, []byte(fmt.Sprintf(
			"root:x:0:0:root:/root:/bin/sh\nagent:x:%d:%d:agent:/home/agent:/bin/sh\n", agentUID, agentUID))),
		a.File("etc/group", 0o644, []byte(fmt.Sprintf("root:x:0:\nagent:x:%d:\n", agentUID))),
		a.File("etc/hostname", 0o644, []byte("carrel\n")),
		a.File("etc/os-release", 0o644, []byte(osRelease(o.Name, release))),
	)
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("lay out root: %w", err)
	}
	return a, nil
}

// CanaryPath is a file of the dev image's root whose content (Canary) is
// found nowhere else in it, so that a test can find its blocks in the
// uncompressed root file system, damage one, and see the guest refuse to
// read it.
const CanaryPath = "/usr/share/carrel/verity-canary"

// Canary is CanaryPath's content: 64 KiB, a SHA-256 chain.
func Canary() []byte {
	b := make([]byte, 0, 64<<10)
	sum := sha256.Sum256([]byte("carrel verity canary"))
	for len(b) < cap(b) {
		b = append(b, sum[:]...)
		sum = sha256.Sum256(sum[:])
	}
	return b
}

func osRelease(name, release string) string {
	return fmt.Sprintf(`NAME="carrel"
ID=carrel
VARIANT="development image"
VARIANT_ID=dev
IMAGE_ID=%s
PRETTY_NAME="carrel development image (Debian kernel %s)"
HOME_URL="https://github.com/carrel-os/carrel"
`, name, release)
}
