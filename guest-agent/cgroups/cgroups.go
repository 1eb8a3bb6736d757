//go:build linux

// Package cgroups gives each command carrel-agent starts a cgroup v2 group
// of its own, named by the command's id, and tells which command a process
// belongs to from the group it is in.
//
// A process is born into its command's group (clone3 with
// CLONE_INTO_CGROUP, through syscall.SysProcAttr.CgroupFD), and so is
// every process it starts, whatever becomes of its parent. The groups
// belong to root: the unprivileged user commands run as cannot move a
// process out of its group.
package cgroups

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// Mount is where the cgroup v2 hierarchy is mounted.
const Mount = "/sys/fs/cgroup"

// maxLeftovers caps the groups kept for a later removal; past it, the
// oldest are forgotten (left in place, empty or not).
const maxLeftovers = 4096

// ErrNotCgroup2 is returned by Open when the mount is not a cgroup v2
// hierarchy.
var ErrNotCgroup2 = errors.New("not a cgroup v2 hierarchy")

// Dir is the cgroup under which commands get their groups. It is safe for
// concurrent use.
type Dir struct {
	dir string // in the file system: /sys/fs/cgroup/carrel
	rel string // in the hierarchy, as /proc/PID/cgroup shows it: /carrel

	mu       sync.Mutex
	leftover []string // ids of groups that were still busy when their command ended
}

// Open makes (or reuses) the cgroup named name directly below mount, the
// mount point of a cgroup v2 hierarchy in the caller's cgroup namespace.
func Open(mount, name string) (*Dir, error) {
	if !validName(name) {
		return nil, fmt.Errorf("cgroups: invalid group name %q", name)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(mount, &st); err != nil {
		return nil, fmt.Errorf("cgroups: %s: %w", mount, err)
	}
	if st.Type != unix.CGROUP2_SUPER_MAGIC {
		return nil, fmt.Errorf("cgroups: %s: %w", mount, ErrNotCgroup2)
	}
	d := &Dir{dir: filepath.Join(mount, name), rel: "/" + name}
	if err := os.Mkdir(d.dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("cgroups: %w", err)
	}
	return d, nil
}

// OpenDelegated is Open for an agent that runs as a service of the
// image's init system, which delegated the service's cgroup to it
// (systemd's Delegate=yes): it moves the agent's own process into a leaf
// of that cgroup (agent), since a group whose children run processes may
// not run any itself, and opens carrel beside it for the commands. The
// cgroup is the agent's as /proc/self/cgroup names it, below mount.
func OpenDelegated(mount string) (*Dir, error) {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return nil, fmt.Errorf("cgroups: %w", err)
	}
	own := ""
	for _, line := range strings.Split(string(b), "\n") {
		if p, ok := strings.CutPrefix(line, "0::"); ok {
			own = p
		}
	}
	if own == "" || !strings.HasPrefix(own, "/") || path.Clean(own) != own {
		return nil, fmt.Errorf("cgroups: the agent's own cgroup v2 group is not known (/proc/self/cgroup: %q)", b)
	}
	if own == "/" {
		return nil, errors.New("cgroups: the agent runs in the root cgroup: nothing was delegated to it")
	}
	base := filepath.Join(mount, filepath.FromSlash(own))
	leaf := filepath.Join(base, "agent")
	if err := os.Mkdir(leaf, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("cgroups: %w (is the service's cgroup delegated?)", err)
	}
	if err := os.WriteFile(filepath.Join(leaf, "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())), 0); err != nil {
		return nil, fmt.Errorf("cgroups: move the agent into %s: %w", leaf, err)
	}
	d := &Dir{dir: filepath.Join(base, "carrel"), rel: path.Join(own, "carrel")}
	if err := os.Mkdir(d.dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("cgroups: %w", err)
	}
	return d, nil
}

// Path is the directory of Dir in the file system.
func (d *Dir) Path() string { return d.dir }

// Create makes the group for the command with the given id and returns it
// open, for SysProcAttr.CgroupFD; the caller closes it once the command has
// started. An error wrapping os.ErrExist means the id is taken. Groups
// left behind by earlier commands are removed first, where they have
// emptied.
func (d *Dir) Create(id string) (*os.File, error) {
	if !validName(id) {
		return nil, fmt.Errorf("cgroups: invalid group name %q", id)
	}
	d.Sweep()
	p := filepath.Join(d.dir, id)
	if err := os.Mkdir(p, 0o755); err != nil {
		return nil, fmt.Errorf("cgroups: %w", err)
	}
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		_ = unix.Rmdir(p)
		return nil, fmt.Errorf("cgroups: %w", err)
	}
	return f, nil
}

// Remove removes the command's group once its last process is gone. A
// group still busy (a daemon the command left running) is kept and
// removed by a later Create or Sweep once it empties.
func (d *Dir) Remove(id string) {
	if !validName(id) {
		return
	}
	if err := unix.Rmdir(filepath.Join(d.dir, id)); errors.Is(err, unix.EBUSY) {
		d.mu.Lock()
		if len(d.leftover) >= maxLeftovers {
			d.leftover = d.leftover[1:]
		}
		d.leftover = append(d.leftover, id)
		d.mu.Unlock()
	}
}

// Sweep removes the groups kept by Remove that have emptied since.
func (d *Dir) Sweep() {
	d.mu.Lock()
	defer d.mu.Unlock()
	kept := d.leftover[:0]
	for _, id := range d.leftover {
		if err := unix.Rmdir(filepath.Join(d.dir, id)); errors.Is(err, unix.EBUSY) {
			kept = append(kept, id)
		}
	}
	clear(d.leftover[len(kept):])
	d.leftover = kept
}

// ExecID returns the id of the command whose group process pid is in, from
// /proc/PID/cgroup; false if the process is gone or in no command's group.
func (d *Dir) ExecID(pid int) (string, bool) {
	if pid <= 0 {
		return "", false
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup")
	if err != nil {
		return "", false
	}
	return d.execIDFrom(b)
}

// execIDFrom finds the unified hierarchy's line ("0::/carrel/<id>", or a
// group below it) in the contents of /proc/PID/cgroup.
func (d *Dir) execIDFrom(b []byte) (string, bool) {
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := sc.Bytes()
		rest, ok := bytes.CutPrefix(line, []byte("0::"))
		if !ok {
			continue
		}
		p := string(rest)
		below, ok := strings.CutPrefix(p, d.rel+"/")
		if !ok || path.Clean(p) != p {
			return "", false
		}
		id, _, _ := strings.Cut(below, "/")
		if !validName(id) {
			return "", false
		}
		return id, true
	}
	return "", false
}

// validName: a group is named as command ids are.
func validName(s string) bool { return protocol.ValidExecID(s) }

// SetMaxProcesses caps the processes (and threads) of every command
// together: pids.max of the Dir, with the pids controller enabled for it.
// Commands cannot raise it: the files belong to root.
func (d *Dir) SetMaxProcesses(n uint64) error {
	ctl := filepath.Join(filepath.Dir(d.dir), "cgroup.subtree_control")
	if err := os.WriteFile(ctl, []byte("+pids"), 0); err != nil {
		return fmt.Errorf("cgroups: enable the pids controller: %w", err)
	}
	if err := os.WriteFile(filepath.Join(d.dir, "pids.max"), []byte(strconv.FormatUint(n, 10)), 0); err != nil {
		return fmt.Errorf("cgroups: set pids.max: %w", err)
	}
	return nil
}
