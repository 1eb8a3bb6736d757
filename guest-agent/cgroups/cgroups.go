//go:build linux

// Package cgroups gives each command carrel-agent starts a cgroup v2 group
// of its own, and tells which command a process belongs to from the group
// it is in.
//
// A process is born into its command's group (clone3 with
// CLONE_INTO_CGROUP, through syscall.SysProcAttr.CgroupFD), and so is
// every process it starts, whatever becomes of its parent. The groups
// belong to root: the unprivileged user commands run as cannot move a
// process out of its group, nor change the group.
//
// A group is made for a command and named by its id, or is one kept from
// an earlier command (Release, Take): making and removing a cgroup costs
// an emulated guest about a millisecond and a half of CPU per command,
// most of it in the kernel's work after the removal. A group is kept only
// when it is empty, not frozen, and its command ran as an unprivileged
// user, which cannot write the group's files.
//
// The Dir holds each group's directory and cgroup.events open from its
// making to its removal (Group), and reads the events with pread: opening
// a cgroup file costs an emulated guest several times what reading it
// does.
package cgroups

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"slices"
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

// maxFree caps the empty groups kept for later commands: enough for a
// few commands at once; past it, a group is removed as before.
const maxFree = 8

// ErrNotCgroup2 is returned by Open when the mount is not a cgroup v2
// hierarchy.
var ErrNotCgroup2 = errors.New("not a cgroup v2 hierarchy")

// Dir is the cgroup under which commands get their groups. It is safe for
// concurrent use.
type Dir struct {
	dir string // in the file system: /sys/fs/cgroup/carrel
	rel string // in the hierarchy, as /proc/PID/cgroup shows it: /carrel

	mu       sync.Mutex
	leftover []string // names of groups that were still busy when their command ended
	// open are the groups made or taken and not yet removed, by name;
	// free are those of them kept empty for later commands. holder maps
	// the name of a group taken from free to the id of the command that
	// holds it (a group made for a command is named by its id).
	open     map[string]*Group
	free     []*Group
	holder   map[string]string
	sweeping bool // a Sweep started by sweepLater is under way
}

// A Group is a command's group, made by Create or kept from an earlier
// command and given by Take, with its directory and cgroup.events open.
// The Dir owns both descriptors: they stay open while the group is kept,
// and are closed when it is removed.
type Group struct {
	// Name names the group: the id of the command it was made for.
	Name   string
	dir    int
	events int
}

// FD is the group's directory, open, for SysProcAttr.CgroupFD. It is
// valid until the group is released or removed.
func (g *Group) FD() int { return g.dir }

// state reads the group's cgroup.events. ok is false when it cannot be
// read: the group was removed (by root in the guest), or its file is not
// as the kernel writes it.
func (g *Group) state() (populated, frozen, ok bool) {
	var buf [128]byte
	n, err := unix.Pread(g.events, buf[:], 0)
	if err != nil || n <= 0 || n == len(buf) {
		return true, true, false
	}
	populated, frozen = true, true
	for line := range strings.Lines(string(buf[:n])) {
		switch strings.TrimSpace(line) {
		case "populated 0":
			populated = false
		case "frozen 0":
			frozen = false
		}
	}
	return populated, frozen, true
}

// Empty reports whether the group holds no process, in it or below it,
// and is not frozen (cgroup.events: "populated 0", "frozen 0"); false if
// it was removed.
func (g *Group) Empty() bool {
	populated, frozen, ok := g.state()
	return ok && !populated && !frozen
}

func (g *Group) close() {
	unix.Close(g.events)
	unix.Close(g.dir)
}

// openGroup opens the group at p.
func openGroup(name, p string) (*Group, error) {
	dir, err := unix.Open(p, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: p, Err: err}
	}
	events, err := unix.Openat(dir, "cgroup.events", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		unix.Close(dir)
		return nil, &os.PathError{Op: "open", Path: filepath.Join(p, "cgroup.events"), Err: err}
	}
	return &Group{Name: name, dir: dir, events: events}, nil
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
// open. An error wrapping os.ErrExist means the id is taken. Groups left
// behind by earlier commands are removed first, where they have emptied.
func (d *Dir) Create(id string) (*Group, error) {
	if !validName(id) {
		return nil, fmt.Errorf("cgroups: invalid group name %q", id)
	}
	d.Sweep()
	p := filepath.Join(d.dir, id)
	if err := os.Mkdir(p, 0o755); err != nil {
		return nil, fmt.Errorf("cgroups: %w", err)
	}
	g, err := openGroup(id, p)
	if err != nil {
		_ = unix.Rmdir(p)
		return nil, fmt.Errorf("cgroups: %w", err)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.open == nil {
		d.open = map[string]*Group{}
	}
	d.open[id] = g
	return g, nil
}

// Take gives the command with the given id an empty group kept by
// Release; ok is false when no group is kept. A kept group that root in
// the guest has removed, frozen or put a process in meanwhile is not
// given: it is removed (or left to Sweep, held by no command) as Remove
// does.
func (d *Dir) Take(id string) (g *Group, ok bool) {
	if !validName(id) {
		return nil, false
	}
	for {
		d.mu.Lock()
		if len(d.free) == 0 {
			d.mu.Unlock()
			return nil, false
		}
		g = d.free[len(d.free)-1]
		d.free = d.free[:len(d.free)-1]
		if g.Empty() {
			if d.holder == nil {
				d.holder = map[string]string{}
			}
			d.holder[g.Name] = id
			d.mu.Unlock()
			return g, true
		}
		d.mu.Unlock()
		d.Discard(g.Name)
	}
}

// Discard removes a group that no command holds, as Remove does: a
// process found in it (root in the guest put it there) is no command's.
func (d *Dir) Discard(name string) {
	if !validName(name) {
		return
	}
	d.mu.Lock()
	if d.holder == nil {
		d.holder = map[string]string{}
	}
	d.holder[name] = ""
	d.mu.Unlock()
	d.Remove(name)
}

// Release is Remove for a command whose last process is gone, except
// that the group, when keep is true (its command ran as an unprivileged
// user) and it is empty, is kept for a later command (Take) instead. As
// Create does, it then removes, in the background, the groups kept by
// Remove that have emptied since. A group is released once, by the
// command holding it, and its FD is not used after.
func (d *Dir) Release(name string, keep bool) {
	if !validName(name) {
		return
	}
	defer d.sweepLater()
	d.mu.Lock()
	g := d.open[name]
	if g != nil && slices.Contains(d.free, g) {
		d.mu.Unlock()
		return // kept already
	}
	if keep && g != nil && len(d.free) < maxFree && g.Empty() {
		delete(d.holder, name)
		d.free = append(d.free, g)
		d.mu.Unlock()
		return
	}
	d.mu.Unlock()
	d.Remove(name)
}

// sweepLater starts a Sweep unless one is under way, when there are
// groups to sweep.
func (d *Dir) sweepLater() {
	d.mu.Lock()
	start := len(d.leftover) > 0 && !d.sweeping
	d.sweeping = d.sweeping || start
	d.mu.Unlock()
	if start {
		go func() {
			d.Sweep()
			d.mu.Lock()
			d.sweeping = false
			d.mu.Unlock()
		}()
	}
}

// Remove removes the command's group once its last process is gone, and
// takes it off the list of kept groups if it is there. A group still busy
// (a daemon the command left running) is kept and removed by a later
// Sweep (after a Create or Release) once it empties.
// Past maxLeftovers, the oldest kept group is forgotten: left in place,
// and still its holder's for ExecID.
func (d *Dir) Remove(name string) {
	if !validName(name) {
		return
	}
	d.mu.Lock()
	g := d.open[name]
	delete(d.open, name)
	d.free = slices.DeleteFunc(d.free, func(f *Group) bool { return f == g })
	d.mu.Unlock()
	if g != nil {
		g.close()
	}
	err := unix.Rmdir(filepath.Join(d.dir, name))
	d.mu.Lock()
	defer d.mu.Unlock()
	if !errors.Is(err, unix.EBUSY) {
		delete(d.holder, name)
		return
	}
	if len(d.leftover) >= maxLeftovers {
		d.leftover = d.leftover[1:]
	}
	d.leftover = append(d.leftover, name)
}

// Sweep removes the groups kept by Remove that have emptied since. It
// does not hold the Dir's lock while it removes them, so Take and ExecID
// do not wait for it.
func (d *Dir) Sweep() {
	d.mu.Lock()
	names := slices.Clone(d.leftover)
	d.mu.Unlock()
	var gone []string
	for _, name := range names {
		if err := unix.Rmdir(filepath.Join(d.dir, name)); !errors.Is(err, unix.EBUSY) {
			gone = append(gone, name)
		}
	}
	if len(gone) == 0 {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.leftover = slices.DeleteFunc(d.leftover, func(name string) bool { return slices.Contains(gone, name) })
	for _, name := range gone {
		delete(d.holder, name)
	}
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

// execIDFrom finds the unified hierarchy's line ("0::/carrel/<group>", or a
// group below it) in the contents of /proc/PID/cgroup, and gives the id of
// the command that holds the group.
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
		name, _, _ := strings.Cut(below, "/")
		if !validName(name) {
			return "", false
		}
		d.mu.Lock()
		defer d.mu.Unlock()
		if id, ok := d.holder[name]; ok {
			return id, id != "" // "": held by no command
		}
		if slices.ContainsFunc(d.free, func(g *Group) bool { return g.Name == name }) {
			return "", false // held by no command
		}
		return name, true
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
