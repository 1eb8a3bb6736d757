// Package jail starts a program, QEMU, as an unprivileged user that sees
// only the files it is given.
//
// carreld cannot set up a mount namespace between fork and exec (Go runs
// no code there), so it starts itself again as a small helper (Command,
// then Main in the child), in new mount, network, IPC and UTS namespaces.
// As root, in its own namespace, the helper:
//
//   - makes every mount private, so nothing it does reaches the host;
//   - mounts an empty tmpfs at Spec.Root and builds the jail there: /usr
//     (and /nix/store, on NixOS) and the links or directories /lib,
//     /lib64, /bin, /sbin read-only,
//     /etc/ld.so.cache, the device nodes Spec.Devices, and each of
//     Spec.Binds at its own path, read-only unless it says otherwise;
//   - pivots into it, unmounts the host's tree and makes the jail's root
//     read-only;
//   - writes Spec.PIDFile (its pid and start time, which the program
//     keeps across exec);
//   - empties its capability bounding set, takes Spec.UID, Spec.GID and
//     Spec.Groups (which clears every capability), sets no_new_privs,
//     marks every descriptor but 0-2 and Spec.KeepFDs close-on-exec, and
//     executes Spec.Argv.
//
// Permissions still apply inside: the helper does not change any file's
// owner or mode. The caller makes what the program must open readable
// (and writable) by Spec.UID, and nothing else.
package jail

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// Arg is the helper's first argument: Main acts only when it is there.
const Arg = "__carrel-jail"

// ExitSetup is the helper's exit status when it could not build the jail
// or start the program; its stderr says why, after "carrel jail: ".
const ExitSetup = 126

// Spec is one jail.
type Spec struct {
	// Root is an empty directory, only root's, where the jail's tmpfs is
	// mounted in the new namespace; the host sees it stay empty.
	Root string `json:"root"`
	// UID and GID the program runs as, and its supplementary groups.
	UID    uint32   `json:"uid"`
	GID    uint32   `json:"gid"`
	Groups []uint32 `json:"groups,omitempty"`
	// Binds are host files and directories the jail shows at the same
	// paths.
	Binds []Bind `json:"binds,omitempty"`
	// Devices are device nodes (e.g. /dev/kvm) shown at the same paths,
	// besides /dev/null, /dev/zero, /dev/full, /dev/random and
	// /dev/urandom, which every jail has.
	Devices []string `json:"devices,omitempty"`
	// MemlockBytes raises RLIMIT_MEMLOCK (VFIO pins guest memory); 0
	// leaves it.
	MemlockBytes uint64 `json:"memlock_bytes,omitempty"`
	// PIDFile, when set, gets "PID STARTTIME\n" before the program runs.
	PIDFile string `json:"pid_file,omitempty"`
	// KeepFDs is how many descriptors from 3 on (the command's
	// ExtraFiles) the program gets; every other one above 2 is closed at
	// exec, whoever opened it.
	KeepFDs int `json:"keep_fds,omitempty"`
	// Argv is the program, by a path the jail shows, and its arguments.
	Argv []string `json:"argv"`
}

// Bind is a host path shown in the jail.
type Bind struct {
	Path     string `json:"path"`
	Writable bool   `json:"writable,omitempty"`
}

// baseDevices are in every jail.
var baseDevices = []string{"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"}

// Command returns the command that runs s through helper, the path of a
// binary whose main calls Main first (carreld). The caller sets its
// output, ExtraFiles (kept open across the exec) and anything else of
// SysProcAttr but Cloneflags.
func Command(helper string, s Spec) (*exec.Cmd, error) {
	if s.UID == 0 || s.GID == 0 {
		return nil, errors.New("jail: the program must not run as root (uid or gid 0)")
	}
	if len(s.Argv) == 0 || !filepath.IsAbs(s.Argv[0]) {
		return nil, fmt.Errorf("jail: the program must be named by an absolute path, not %q", s.Argv)
	}
	if !filepath.IsAbs(s.Root) {
		return nil, fmt.Errorf("jail: root %q is not absolute", s.Root)
	}
	b, err := json.Marshal(s)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(helper, Arg, string(b))
	cmd.Env = []string{}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWNS | syscall.CLONE_NEWNET | syscall.CLONE_NEWIPC | syscall.CLONE_NEWUTS,
	}
	return cmd, nil
}

// Main runs the helper when the process was started by Command, and never
// returns then; otherwise it returns at once. Call it first in main.
func Main() {
	if len(os.Args) != 3 || os.Args[1] != Arg {
		return
	}
	// no_new_privs and the bounding set belong to a thread: the one that
	// sets them must be the one that executes the program.
	runtime.LockOSThread()
	var s Spec
	err := json.Unmarshal([]byte(os.Args[2]), &s)
	if err == nil {
		err = run(s)
	}
	fmt.Fprintf(os.Stderr, "carrel jail: %v\n", err)
	os.Exit(ExitSetup)
}

// run sets the jail up and executes the program; it returns only on
// failure.
func run(s Spec) error {
	if s.UID == 0 || s.GID == 0 || len(s.Argv) == 0 {
		return errors.New("bad spec")
	}
	if s.PIDFile != "" {
		if err := writePID(s.PIDFile); err != nil {
			return err
		}
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	if err := unix.Mount("tmpfs", s.Root, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0755,size=1m"); err != nil {
		return fmt.Errorf("mount the jail's root: %w", err)
	}
	if err := populate(s); err != nil {
		return err
	}
	if err := enter(s.Root); err != nil {
		return err
	}
	if s.MemlockBytes > 0 {
		lim := unix.Rlimit{Cur: s.MemlockBytes, Max: s.MemlockBytes}
		if err := unix.Setrlimit(unix.RLIMIT_MEMLOCK, &lim); err != nil {
			return fmt.Errorf("raise the memlock limit: %w", err)
		}
	}
	if err := drop(s); err != nil {
		return err
	}
	// Descriptors carreld inherited without close-on-exec would reach the
	// program: mark them all (closing them under the Go runtime could
	// take its own).
	if err := unix.CloseRange(uint(3+s.KeepFDs), ^uint(0)>>32, unix.CLOSE_RANGE_CLOEXEC); err != nil {
		return fmt.Errorf("close inherited descriptors at exec: %w", err)
	}
	return fmt.Errorf("exec %s: %w", s.Argv[0], unix.Exec(s.Argv[0], s.Argv, []string{}))
}

// writePID writes this process's pid and start time, which the program
// it becomes keeps.
func writePID(path string) error {
	b, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		return err
	}
	// The fields after the command name, which may hold anything.
	i := strings.LastIndexByte(string(b), ')')
	f := strings.Fields(string(b[i+1:]))
	if i < 0 || len(f) < 20 {
		return errors.New("parse /proc/self/stat")
	}
	line := strconv.Itoa(os.Getpid()) + " " + f[19] + "\n"
	if err := os.WriteFile(path, []byte(line), 0o600); err != nil {
		return fmt.Errorf("write the pid file: %w", err)
	}
	return nil
}

// populate builds the jail's tree under s.Root.
func populate(s Spec) error {
	root := s.Root
	if err := bind(root, "/usr", false, false); err != nil {
		return err
	}
	// Merged /usr makes these links into it; elsewhere they are
	// directories of their own.
	for _, p := range []string{"/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"} {
		fi, err := os.Lstat(p)
		switch {
		case errors.Is(err, os.ErrNotExist):
			continue
		case err != nil:
			return err
		case fi.Mode()&os.ModeSymlink != 0:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			if err := os.Symlink(target, filepath.Join(root, p)); err != nil {
				return err
			}
		case fi.IsDir():
			if err := bind(root, p, false, false); err != nil {
				return err
			}
		}
	}
	// NixOS keeps programs and their libraries in the store, which is
	// readable by all anyway.
	if _, err := os.Stat("/nix/store"); err == nil {
		if err := bind(root, "/nix/store", false, false); err != nil {
			return err
		}
	}
	if _, err := os.Stat("/etc/ld.so.cache"); err == nil {
		if err := bind(root, "/etc/ld.so.cache", false, false); err != nil {
			return err
		}
	}
	for _, d := range append(baseDevices, s.Devices...) {
		if err := bind(root, d, true, true); err != nil {
			return err
		}
	}
	// A bind inside a directory already shown would make its mount
	// point in the host's directory.
	shown := []string{"/usr", "/etc", "/dev", "/nix/store"}
	for _, b := range s.Binds {
		for _, d := range shown {
			if strings.HasPrefix(b.Path, d+"/") || b.Path == d {
				return fmt.Errorf("bind %s: it lies in %s, which the jail shows already", b.Path, d)
			}
		}
		if err := bind(root, b.Path, b.Writable, false); err != nil {
			return err
		}
		if fi, err := os.Stat(b.Path); err == nil && fi.IsDir() {
			shown = append(shown, b.Path)
		}
	}
	return nil
}

// bind shows the host's path at the same path under root: read-only
// unless writable, and without device nodes or set-id programs unless
// dev.
func bind(root, path string, writable, dev bool) error {
	if !filepath.IsAbs(path) || filepath.Clean(path) != path {
		return fmt.Errorf("bind %q: not a clean absolute path", path)
	}
	fi, err := os.Stat(path)
	if err != nil {
		return fmt.Errorf("bind: %w", err)
	}
	target := filepath.Join(root, path)
	if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
		return fmt.Errorf("bind %s: %w", path, err)
	}
	if fi.IsDir() {
		err = os.Mkdir(target, 0o755)
	} else {
		var f *os.File
		f, err = os.OpenFile(target, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
		if err == nil {
			err = f.Close()
		}
	}
	if err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("bind %s: %w", path, err)
	}
	if err := unix.Mount(path, target, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind %s: %w", path, err)
	}
	flags := uintptr(unix.MS_REMOUNT | unix.MS_BIND | unix.MS_NOSUID)
	if !writable {
		flags |= unix.MS_RDONLY
	}
	if !dev {
		flags |= unix.MS_NODEV
	}
	if err := unix.Mount("", target, "", flags, ""); err != nil {
		return fmt.Errorf("bind %s: set its flags: %w", path, err)
	}
	return nil
}

// enter makes root the root directory, drops the host's tree from the
// namespace and makes the jail's own directories read-only.
func enter(root string) error {
	old := filepath.Join(root, ".host")
	if err := os.Mkdir(old, 0o700); err != nil {
		return err
	}
	if err := unix.PivotRoot(root, old); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return err
	}
	if err := unix.Unmount("/.host", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("unmount the host's tree: %w", err)
	}
	if err := os.Remove("/.host"); err != nil {
		return err
	}
	if err := unix.Mount("", "/", "", unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		return fmt.Errorf("make the jail's root read-only: %w", err)
	}
	return nil
}

// drop gives up root for good on this thread, which then executes the
// program: no capability can come back, not even through a set-id file.
func drop(s Spec) error {
	for c := 0; c <= unix.CAP_LAST_CAP; c++ {
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("drop capability %d from the bounding set: %w", c, err)
		}
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
		return fmt.Errorf("clear ambient capabilities: %w", err)
	}
	groups := make([]int, len(s.Groups))
	for i, g := range s.Groups {
		groups[i] = int(g)
	}
	// The syscall package changes ids on every thread of the process.
	if err := syscall.Setgroups(groups); err != nil {
		return fmt.Errorf("setgroups: %w", err)
	}
	if err := syscall.Setresgid(int(s.GID), int(s.GID), int(s.GID)); err != nil {
		return fmt.Errorf("setresgid: %w", err)
	}
	if err := syscall.Setresuid(int(s.UID), int(s.UID), int(s.UID)); err != nil {
		return fmt.Errorf("setresuid: %w", err)
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("set no_new_privs: %w", err)
	}
	return nil
}
