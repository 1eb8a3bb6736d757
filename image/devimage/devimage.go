// Package devimage builds the development image in carrel's image format
// (image/imagedir): Debian's stock kernel; an initramfs whose /init is
// carrel-agent, with the virtio, vsock, ext4, dm-verity, erofs and overlay
// modules it loads at boot; a small verified root (erofs under dm-verity,
// image/sysroot) with busybox for a shell; and the template of the VMs'
// workspace disks (image/workspace). The agent mounts the root, with the
// VM's writable layer over it, and switches to it. Userland images are
// built by image/debian and the NixOS flake (see nix/).
//
// Options.WithQemuGA builds a variant that also holds Debian's qemu-ga
// (qemu-guest-agent) with its shared libraries, which the benchmarks
// compare carrel-agent with (see qemuga.go and tests/bench).
//
// Build fetches packages with apt-get download and unpacks them with
// dpkg-deb -x into a cache it reuses, so it needs a Debian host (and
// mkfs.ext4, from e2fsprogs) but never installs anything on it. The same inputs always give byte-identical
// files and the same manifest digest.
package devimage

import (
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"

	"github.com/carrel-os/carrel/image/manifest"
)

const (
	// DefaultName is the manifest name of the development image.
	DefaultName = "carrel-dev"
	// DefaultKernelPackage is Debian's meta package for the current kernel.
	DefaultKernelPackage = "linux-image-amd64"
	// DefaultCmdline is the kernel command line the manifest records: the
	// console on the first serial port, and a reboot (which QEMU run with
	// -no-reboot turns into an exit) as soon as the kernel panics, e.g.
	// because /init, the agent, died.
	DefaultCmdline = "console=ttyS0 quiet panic=-1"
	// BusyboxPackage provides the image's shell and core utilities.
	BusyboxPackage = "busybox-static"

	arch = "amd64"
)

// DefaultModules are the modules loaded at boot, before their dependencies
// are added: the Debian kernel builds all of virtio and vsock as modules.
var DefaultModules = []string{
	"virtio_mmio",
	"virtio_pci",
	"virtio_console",
	"virtio_blk",
	// The workspace disk's file system; ext4 asks the crypto API for
	// crc32c (metadata checksums) only when it mounts, and the guest has
	// no modprobe to load it then.
	"crc32c_generic",
	"ext4",
	"vsock",
	"vmw_vsock_virtio_transport",
	// The verified root: dm-verity over the system disk, erofs on it, and
	// the VM's writable layer over that.
	"dm_verity",
	"erofs",
	"overlay",
	// SIMD SHA-256 for dm-verity's hashing (the kernel prefers it to the
	// generic C code once it is loaded).
	"sha256_ssse3",
}

// Options configures Build. CacheDir, OutDir and AgentBinary are required.
type Options struct {
	// CacheDir keeps downloaded packages and their unpacked trees between
	// builds; a package is downloaded only when the cache lacks it.
	CacheDir string
	// OutDir receives the image directory (image/imagedir); it is created
	// if needed and existing files are replaced atomically.
	OutDir string
	// AgentBinary is the static carrel-agent executable, installed as /init.
	AgentBinary string
	// KernelPackage is the Debian package providing the kernel and its
	// modules; meta packages are followed. Default DefaultKernelPackage.
	KernelPackage string
	// Modules are loaded at boot, with their dependencies first. Nil means
	// DefaultModules; an empty non-nil slice means none.
	Modules []string
	// Name is the manifest's image name. Default DefaultName.
	Name string
	// Cmdline is the manifest's kernel command line. Default DefaultCmdline.
	Cmdline string
	// Compress gzips the initramfs. It is off by default: under TCG the
	// kernel spends longer decompressing than it saves reading.
	Compress bool
	// WithQemuGA builds the qemu-guest-agent variant: the image also holds
	// Debian's qemu-ga at QemuGABinary with its shared libraries and
	// dynamic loader, for benchmarks against it. /init is still
	// carrel-agent and nothing starts qemu-ga (see QemuGAPortName). Name
	// defaults to QemuGAName.
	WithQemuGA bool
	// LibDirs are the host directories searched for qemu-ga's shared
	// libraries after the package's own tree. Nil means DefaultLibDirs.
	LibDirs []string
	// RootTree, when set, is the root file system, laid out by the caller
	// (image/debian), in place of the busybox root; RootPackages are its
	// packages, which the manifest lists beside the kernel's.
	RootTree     string
	RootPackages []manifest.Package
	// RootCompressor compresses the root file system (image/erofs); ""
	// means none, which reads fastest under TCG.
	RootCompressor string
	// Logger receives progress; nil means slog.Default().
	Logger *slog.Logger
}

// Result is what Build produced.
type Result struct {
	KernelPath   string
	InitrdPath   string
	ManifestPath string
	// SystemPath and SystemVerityPath are the verified root and its hash
	// device.
	SystemPath       string
	SystemVerityPath string
	// WorkspacePath is the workspace template.
	WorkspacePath string
	// Manifest records the digests and sizes of the kernel, the initrd and
	// the workspace template.
	Manifest *manifest.Manifest
	// Modules are the guest paths of the modules in /etc/carrel/modules, in
	// load order.
	Modules []string
	// QemuGA is qemu-ga's guest path in the qemu-guest-agent variant
	// (Options.WithQemuGA), else empty; QemuGALibs are the guest paths of
	// its loader and libraries.
	QemuGA     string
	QemuGALibs []string
}

func (o *Options) withDefaults() (Options, error) {
	c := *o
	if c.CacheDir == "" {
		return c, errors.New("cache dir is required")
	}
	if c.OutDir == "" {
		return c, errors.New("output dir is required")
	}
	if c.AgentBinary == "" {
		return c, errors.New("agent binary is required")
	}
	if c.KernelPackage == "" {
		c.KernelPackage = DefaultKernelPackage
	}
	if c.Modules == nil {
		c.Modules = DefaultModules
	}
	c.Modules = slices.Clone(c.Modules)
	if c.Name == "" {
		c.Name = DefaultName
		if c.WithQemuGA {
			c.Name = QemuGAName
		}
	}
	if c.LibDirs == nil {
		c.LibDirs = DefaultLibDirs
	}
	c.LibDirs = slices.Clone(c.LibDirs)
	if !manifest.ValidName(c.Name) {
		return c, fmt.Errorf("image name %q: want [a-z0-9][a-z0-9._-]{0,62}", c.Name)
	}
	if c.Cmdline == "" {
		c.Cmdline = DefaultCmdline
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	c.Logger = c.Logger.With("subsystem", "devimage")
	return c, nil
}

// Build fetches the kernel and busybox packages, assembles the initramfs
// and writes the image to opts.OutDir. It checks that the agent is a static
// x86-64 executable, since a dynamic one cannot run as /init.
func Build(ctx context.Context, opts Options) (*Result, error) {
	o, err := opts.withDefaults()
	if err != nil {
		return nil, fmt.Errorf("build dev image: %w", err)
	}
	if err := checkAgent(o.AgentBinary); err != nil {
		return nil, fmt.Errorf("build dev image: %w", err)
	}
	f, err := newFetcher(o.CacheDir, o.Logger, execRun)
	if err != nil {
		return nil, fmt.Errorf("build dev image: %w", err)
	}
	in, err := fetchInputs(ctx, f, o)
	if err != nil {
		return nil, fmt.Errorf("build dev image: %w", err)
	}
	res, err := assemble(ctx, in, o, execRun)
	if err != nil {
		return nil, fmt.Errorf("build dev image: %w", err)
	}
	return res, nil
}

// inputs are the host files an image is assembled from.
type inputs struct {
	kernel     string // vmlinuz-<release>
	moduleRoot string // lib/modules/<release>
	busybox    string // static busybox executable
	qemuGA     *dynamicBinary
	// packages are the Debian packages the image is made of, for its
	// manifest.
	packages []manifest.Package
}

func fetchInputs(ctx context.Context, f *fetcher, o Options) (inputs, error) {
	others := []string{BusyboxPackage}
	if o.WithQemuGA {
		others = append(others, QemuGAPackage)
	}
	pkgs, err := f.fetch(ctx, o.KernelPackage, others...)
	if err != nil {
		return inputs{}, err
	}
	ktree, kpkg := pkgs[0].tree, pkgs[0].pkg
	btree, bpkg := pkgs[1].tree, pkgs[1].pkg
	kernels, err := filepath.Glob(filepath.Join(ktree, "boot", "vmlinuz-*"))
	if err != nil || len(kernels) != 1 {
		return inputs{}, fmt.Errorf("package %s %s: want one boot/vmlinuz-*, found %d", kpkg.Name, kpkg.Version, len(kernels))
	}
	release := filepath.Base(kernels[0])[len("vmlinuz-"):]
	in := inputs{kernel: kernels[0]}
	for _, f := range pkgs {
		if o.RootTree != "" && f.pkg.Name != kpkg.Name {
			continue // busybox and qemu-ga are in the dev root only
		}
		in.packages = append(in.packages, manifest.Package{Name: f.pkg.Name, Version: f.pkg.Version, Arch: f.pkg.Arch})
	}
	in.packages = append(in.packages, o.RootPackages...)
	for _, dir := range []string{"lib/modules", "usr/lib/modules"} {
		p := filepath.Join(ktree, dir, release)
		if fi, err := os.Stat(p); err == nil && fi.IsDir() {
			in.moduleRoot = p
			break
		}
	}
	if in.moduleRoot == "" {
		return inputs{}, fmt.Errorf("package %s %s: no modules for release %s", kpkg.Name, kpkg.Version, release)
	}
	for _, p := range []string{"bin/busybox", "usr/bin/busybox"} {
		if fi, err := os.Stat(filepath.Join(btree, p)); err == nil && fi.Mode().IsRegular() {
			in.busybox = filepath.Join(btree, p)
			break
		}
	}
	if in.busybox == "" {
		return inputs{}, fmt.Errorf("package %s %s: no busybox binary", bpkg.Name, bpkg.Version)
	}
	f.log.Info("image inputs", "kernel_package", kpkg.Name, "kernel_version", kpkg.Version,
		"release", release, "busybox_version", bpkg.Version)
	if o.WithQemuGA {
		qpkg := pkgs[2].pkg
		if in.qemuGA, err = qemuGAInputs(pkgs[2].tree, o.LibDirs); err != nil {
			return inputs{}, fmt.Errorf("package %s %s: %w", qpkg.Name, qpkg.Version, err)
		}
		f.log.Info("qemu-guest-agent variant", "version", qpkg.Version, "libraries", len(in.qemuGA.libs))
	}
	return in, nil
}

// checkAgent returns nil if path is a statically linked x86-64 executable.
func checkAgent(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("agent binary %s: %w", path, err)
	}
	defer f.Close()
	if f.Machine != elf.EM_X86_64 || f.Class != elf.ELFCLASS64 {
		return fmt.Errorf("agent binary %s: built for %v, want x86-64", path, f.Machine)
	}
	if f.Type != elf.ET_EXEC && f.Type != elf.ET_DYN {
		return fmt.Errorf("agent binary %s: ELF type %v is not an executable", path, f.Type)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return fmt.Errorf("agent binary %s: dynamically linked; build it with CGO_ENABLED=0", path)
		}
	}
	return nil
}
