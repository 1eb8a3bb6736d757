//go:build linux

// Package initsys does what PID 1 must do when carrel-agent is the
// initramfs's init: mount the kernel file systems (cgroup v2 among them),
// load the kernel modules, set up the image's verified root (dm-verity,
// erofs and the VM's writable layer over it) and switch to it, turn on the
// kernel's link protections, set the hostname, bring up the loopback
// interface, and power the machine off.
// Everything here refuses to run unless the process is PID 1, so that it
// cannot harm a development host.
package initsys

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// ModuleList lists the kernel modules to load, one absolute path per
// line, in load order.
const ModuleList = "/etc/carrel/modules"

// ErrNotInit is returned when the caller is not PID 1.
var ErrNotInit = errors.New("not running as pid 1")

// mount is one file system Setup mounts.
type mount struct {
	source, target, fstype string
	flags                  uintptr
	data                   string
	mode                   os.FileMode // of the target directory, if created
}

const (
	nodevNosuid       = unix.MS_NODEV | unix.MS_NOSUID
	nodevNosuidNoexec = unix.MS_NODEV | unix.MS_NOSUID | unix.MS_NOEXEC
)

// mounts is in dependency order: /dev before /dev/pts, and so on.
var mounts = []mount{
	{"devtmpfs", "/dev", "devtmpfs", unix.MS_NOSUID, "mode=0755", 0o755},
	{"proc", "/proc", "proc", nodevNosuidNoexec, "", 0o555},
	{"sysfs", "/sys", "sysfs", nodevNosuidNoexec, "", 0o555},
	// Each command gets a group of its own here (package cgroups).
	{"cgroup2", "/sys/fs/cgroup", "cgroup2", nodevNosuidNoexec, "", 0o755},
	{"devpts", "/dev/pts", "devpts", unix.MS_NOSUID | unix.MS_NOEXEC, "mode=0620,ptmxmode=0666", 0o755},
	{"shm", "/dev/shm", "tmpfs", nodevNosuid, "mode=1777", 0o1777},
	{"tmpfs", "/tmp", "tmpfs", nodevNosuid, "mode=1777", 0o1777},
	{"tmpfs", "/run", "tmpfs", nodevNosuid, "mode=0755", 0o755},
	{"workspace", "/workspace", "tmpfs", nodevNosuid, "mode=0755,uid=1000,gid=1000", 0o755},
}

// sysctls harden what systemd would otherwise set: no hard links to files
// a user does not own and cannot write (which would carry them into a
// sandbox root), and no following of other users' symlinks in sticky
// directories such as /tmp.
var sysctls = [][2]string{
	{"/proc/sys/fs/protected_hardlinks", "1"},
	{"/proc/sys/fs/protected_symlinks", "1"},
}

// devLinks are created in /dev when missing.
var devLinks = [][2]string{
	{"/proc/self/fd", "/dev/fd"},
	{"/proc/self/fd/0", "/dev/stdin"},
	{"/proc/self/fd/1", "/dev/stdout"},
	{"/proc/self/fd/2", "/dev/stderr"},
	{"pts/ptmx", "/dev/ptmx"},
}

// Setup mounts the kernel file systems and loads the modules listed in
// ModuleList; a module that fails to load is logged and skipped, since
// the transport may not need it. When the kernel command line names a
// verified root (ParseRoot), it then sets that root up and switches to it,
// and executes the command line's init= there if it has one; any failure
// there wraps ErrRoot. Then it mounts the scratch file systems (those not
// mounted yet), creates the usual /dev links, turns on the link
// protections (fs.protected_hardlinks and fs.protected_symlinks), sets the
// hostname from /etc/hostname and brings up the loopback interface.
// /workspace is a tmpfs, or, when the kernel command line says so, the
// workspace disk (an error there wraps ErrWorkspace). A mount failure is
// returned (after trying the rest).
func Setup(log *slog.Logger) error {
	if os.Getpid() != 1 {
		return ErrNotInit
	}
	var errs []error
	kernelFS, scratch := mounts[:3], mounts[3:]
	for _, m := range kernelFS {
		if err := doMount(m); err != nil {
			errs = append(errs, err)
		}
	}
	LoadModules(log, ModuleList)
	cmdline, err := os.ReadFile("/proc/cmdline")
	if err != nil {
		return errors.Join(append(errs, fmt.Errorf("read the kernel command line: %w", err))...)
	}
	root, ok, err := ParseRoot(string(cmdline))
	if err != nil {
		return err
	}
	if ok {
		if err := switchRoot(log, root); err != nil {
			return err
		}
		if root.Init != "" {
			log.Info("executing the image's init", "init", root.Init)
			err := unix.Exec(root.Init, []string{root.Init}, os.Environ())
			return fmt.Errorf("%w: execute init=%s: %w", ErrRoot, root.Init, err)
		}
	}
	var limits Limits
	onDisk := false
	for _, m := range scratch {
		if m.target == "/workspace" {
			l, err := ReadLimits()
			if err != nil {
				log.Warn("limits", "err", err)
			}
			limits = l
			if WorkspaceOnDisk(string(cmdline)) {
				onDisk = true
				continue
			}
			if l.WorkspaceBytes > 0 {
				m.data += fmt.Sprintf(",size=%d", l.WorkspaceBytes)
			}
		}
		if mounted(m.target) {
			continue // /run, set up with the verified root
		}
		if err := doMount(m); err != nil {
			errs = append(errs, err)
		}
	}
	for _, l := range devLinks {
		if err := os.Symlink(l[0], l[1]); err != nil && !errors.Is(err, os.ErrExist) {
			log.Warn("create link", "link", l[1], "err", err)
		}
	}
	for _, kv := range sysctls {
		if err := os.WriteFile(kv[0], []byte(kv[1]), 0); err != nil {
			log.Warn("set sysctl", "path", kv[0], "err", err)
		}
	}
	if err := setHostname("/etc/hostname"); err != nil {
		log.Warn("set hostname", "err", err)
	}
	if err := loopbackUp(); err != nil {
		log.Warn("loopback", "err", err)
	}
	if onDisk {
		if err := mountWorkspaceDisk(log); err != nil {
			errs = append(errs, err)
		}
	} else if limits.WorkspaceBytes > 0 {
		log.Info("workspace size limited", "bytes", limits.WorkspaceBytes)
	}
	return errors.Join(errs...)
}

// mounted reports whether something is mounted on dir: it is on another
// file system than its parent.
func mounted(dir string) bool {
	var st, parent unix.Stat_t
	if unix.Stat(dir, &st) != nil || unix.Stat(filepath.Dir(dir), &parent) != nil {
		return false
	}
	return st.Dev != parent.Dev
}

func doMount(m mount) error {
	if err := os.MkdirAll(m.target, m.mode); err != nil {
		return fmt.Errorf("mount %s: %w", m.target, err)
	}
	err := unix.Mount(m.source, m.target, m.fstype, m.flags, m.data)
	if err != nil && !errors.Is(err, unix.EBUSY) { // EBUSY: already mounted
		return fmt.Errorf("mount %s on %s: %w", m.fstype, m.target, err)
	}
	return nil
}

func setHostname(path string) error {
	name, err := readHostname(path)
	if err != nil || name == "" {
		return err
	}
	return unix.Sethostname([]byte(name))
}

// readHostname returns the first line of path, trimmed; "" if the file
// does not exist.
func readHostname(path string) (string, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return "", nil
	} else if err != nil {
		return "", err
	}
	line, _, _ := strings.Cut(string(b), "\n")
	name := strings.TrimSpace(line)
	if len(name) > 64 {
		return "", fmt.Errorf("hostname %q in %s: longer than 64 bytes", name[:64], path)
	}
	return name, nil
}

// LoadModules loads the modules listed in the file at list, in order, and
// returns how many loaded (or were already loaded). Every failure,
// including a missing list, is logged and skipped.
func LoadModules(log *slog.Logger, list string) int {
	return loadModules(log, list, finitModule)
}

func loadModules(log *slog.Logger, list string, load func(path string) error) int {
	f, err := os.Open(list)
	if err != nil {
		log.Warn("no module list", "list", list, "err", err)
		return 0
	}
	defer f.Close()
	paths, err := ParseModuleList(f)
	if err != nil {
		log.Warn("read module list", "list", list, "err", err)
	}
	n := 0
	for _, p := range paths {
		if err := load(p); err != nil {
			log.Warn("load module", "module", p, "list", list, "err", err)
			continue
		}
		n++
	}
	log.Info("loaded modules", "list", list, "loaded", n, "listed", len(paths))
	return n
}

// ParseModuleList returns the module paths in r: one absolute path per
// line; blank lines and lines starting with # are skipped. A relative path
// is an error, reported after the valid paths are collected.
func ParseModuleList(r io.Reader) ([]string, error) {
	var paths []string
	var errs []error
	sc := bufio.NewScanner(r)
	for line := 1; sc.Scan(); line++ {
		p := strings.TrimSpace(sc.Text())
		if p == "" || strings.HasPrefix(p, "#") {
			continue
		}
		if !filepath.IsAbs(p) {
			errs = append(errs, fmt.Errorf("line %d: %q is not an absolute path", line, p))
			continue
		}
		paths = append(paths, p)
	}
	if err := sc.Err(); err != nil {
		errs = append(errs, err)
	}
	return paths, errors.Join(errs...)
}

// finitModule loads one module file. Compressed modules (.ko.xz, .ko.zst,
// .ko.gz) are decompressed by the kernel, which needs
// CONFIG_MODULE_DECOMPRESS. A module that is already loaded is not an
// error.
func finitModule(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	flags := 0
	switch filepath.Ext(path) {
	case ".xz", ".zst", ".gz":
		flags |= unix.MODULE_INIT_COMPRESSED_FILE
	}
	err = unix.FinitModule(int(f.Fd()), "", flags)
	if err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("finit_module: %w", err)
	}
	return nil
}
