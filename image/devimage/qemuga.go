package devimage

import (
	"debug/elf"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
)

// The qemu-guest-agent variant of the dev image (Options.WithQemuGA) adds
// Debian's qemu-ga, the established guest agent carrel is benchmarked
// against, with the shared libraries it needs. Nothing starts it: /init is
// still carrel-agent, and whoever wants qemu-ga adds a virtio-serial port
// named QemuGAPortName to the VM and starts QemuGABinary on that port's
// device node (as root, e.g. through carrel exec --user root).
const (
	// QemuGAPackage is the Debian package qemu-ga comes from.
	QemuGAPackage = "qemu-guest-agent"
	// QemuGABinary is where qemu-ga is, in the package and in the guest.
	QemuGABinary = "/usr/sbin/qemu-ga"
	// QemuGAPortName is the virtio-serial port name qemu-ga conventionally
	// serves (libvirt and QEMU's docs use it).
	QemuGAPortName = "org.qemu.guest_agent.0"
	// QemuGAName is the manifest name of the variant when Options.Name is
	// not set.
	QemuGAName = "carrel-dev-qga"
	// guestLibDir is where the variant's shared libraries go: a directory
	// Debian's dynamic loader searches by default.
	guestLibDir = "usr/lib/x86_64-linux-gnu"
)

// DefaultLibDirs are the host directories searched for qemu-ga's shared
// libraries, after the package's own tree. The host is expected to be
// Debian on x86-64, the release the package comes from.
var DefaultLibDirs = []string{"/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu"}

// sharedObject is one host ELF file the guest needs at a fixed path.
type sharedObject struct {
	guest string // path in the initramfs, relative
	src   string // host file (symlinks resolved)
}

// dynamicBinary is an executable plus what the loader needs to run it.
type dynamicBinary struct {
	binary string         // host file
	interp *sharedObject  // the dynamic loader, at its PT_INTERP path; nil if static
	libs   []sharedObject // the DT_NEEDED closure, in the order found
}

// qemuGAInputs finds qemu-ga in the unpacked package tree and resolves its
// libraries in the tree, then in libDirs.
func qemuGAInputs(tree string, libDirs []string) (*dynamicBinary, error) {
	bin := filepath.Join(tree, filepath.FromSlash(strings.TrimPrefix(QemuGABinary, "/")))
	if fi, err := os.Stat(bin); err != nil || !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("package %s has no regular file %s", QemuGAPackage, QemuGABinary)
	}
	dirs := []string{filepath.Join(tree, "lib/x86_64-linux-gnu"), filepath.Join(tree, "usr/lib/x86_64-linux-gnu")}
	return resolveDynamic(bin, append(dirs, libDirs...))
}

// resolveDynamic reads bin's program interpreter and, transitively, its
// DT_NEEDED entries, finding each library in the first of dirs that holds
// an x86-64 ELF object of that name (as the loader skips objects of the
// wrong class). Libraries are installed under their DT_NEEDED name in
// guestLibDir; the loader at its PT_INTERP path.
func resolveDynamic(bin string, dirs []string) (*dynamicBinary, error) {
	f, err := openX8664(bin)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := &dynamicBinary{binary: bin}
	interp, err := interpreter(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", bin, err)
	}
	if interp == "" {
		return out, nil // static: nothing to add
	}
	if !path.IsAbs(interp) || path.Clean(interp) != interp {
		return nil, fmt.Errorf("%s: odd program interpreter %q", bin, interp)
	}
	loaderName := path.Base(interp)
	loader, err := findLib(loaderName, dirs)
	if err != nil {
		return nil, fmt.Errorf("%s: program interpreter %s: %w", bin, interp, err)
	}
	out.interp = &sharedObject{guest: strings.TrimPrefix(interp, "/"), src: loader}

	queue, err := f.ImportedLibraries()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", bin, err)
	}
	seen := map[string]bool{loaderName: true} // the loader satisfies its own soname
	for len(queue) > 0 {
		name := queue[0]
		queue = queue[1:]
		if seen[name] {
			continue
		}
		seen[name] = true
		if name != path.Base(name) || name == "." || name == ".." {
			return nil, fmt.Errorf("%s: DT_NEEDED %q is not a plain file name", bin, name)
		}
		src, err := findLib(name, dirs)
		if err != nil {
			return nil, fmt.Errorf("%s needs %s: %w", filepath.Base(bin), name, err)
		}
		out.libs = append(out.libs, sharedObject{guest: path.Join(guestLibDir, name), src: src})
		lf, err := openX8664(src)
		if err != nil {
			return nil, err
		}
		more, err := lf.ImportedLibraries()
		lf.Close()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", src, err)
		}
		queue = append(queue, more...)
	}
	return out, nil
}

// findLib returns the real path of the first x86-64 ELF file called name in
// dirs.
func findLib(name string, dirs []string) (string, error) {
	for _, d := range dirs {
		p, err := filepath.EvalSymlinks(filepath.Join(d, name))
		if err != nil {
			continue
		}
		if fi, err := os.Stat(p); err != nil || !fi.Mode().IsRegular() {
			continue
		}
		f, err := openX8664(p)
		if err != nil {
			continue
		}
		f.Close()
		return p, nil
	}
	return "", fmt.Errorf("no x86-64 %s in %s (on Debian, install the package that ships it)", name, strings.Join(dirs, ", "))
}

// openX8664 opens an ELF file and checks that it is 64-bit x86.
func openX8664(p string) (*elf.File, error) {
	f, err := elf.Open(p)
	if err != nil {
		return nil, err
	}
	if f.Machine != elf.EM_X86_64 || f.Class != elf.ELFCLASS64 {
		f.Close()
		return nil, fmt.Errorf("%s: built for %v %v, want x86-64", p, f.Class, f.Machine)
	}
	return f, nil
}

// interpreter returns the PT_INTERP path of f, or "" if it has none.
func interpreter(f *elf.File) (string, error) {
	for _, p := range f.Progs {
		if p.Type != elf.PT_INTERP {
			continue
		}
		if p.Filesz > 4096 {
			return "", errors.New("PT_INTERP is too long")
		}
		b := make([]byte, p.Filesz)
		if _, err := p.ReadAt(b, 0); err != nil {
			return "", fmt.Errorf("read PT_INTERP: %w", err)
		}
		return strings.TrimRight(string(b), "\x00"), nil
	}
	return "", nil
}

// addDynamic adds the binary at its guest path with its loader and
// libraries.
func addDynamic(add func(name string, perm fs.FileMode, src string) error, guestPath string, d *dynamicBinary) []error {
	errs := []error{add(strings.TrimPrefix(guestPath, "/"), 0o755, d.binary)}
	if d.interp != nil {
		errs = append(errs, add(d.interp.guest, 0o755, d.interp.src))
	}
	for _, l := range d.libs {
		errs = append(errs, add(l.guest, 0o644, l.src))
	}
	return errs
}
