package qemu

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/carrel-os/carrel/supervisor/driver"
	"github.com/carrel-os/carrel/supervisor/jail"
)

// Jail runs each VM's QEMU as a user of its own, in a jail (package jail)
// that shows it only its kernel, initrd, disks and their layers, its VM's
// directory, /usr and a few device nodes, with no capabilities,
// no_new_privs, a network namespace with no interfaces, and its seccomp
// filter as before. One user per VM rather than one carrel-qemu user for
// all: two QEMUs of one user could signal, trace or read each other
// (/proc/PID/root reaches into the other's jail), and a guest that
// escapes into its QEMU would have every VM's disks.
//
// The users are not in /etc/passwd: a VM's is UIDBase plus the lowest slot
// no running QEMU holds (its group has the same number). carreld hands
// the files over at each start: the VM's directory becomes root:GID 0710,
// its writable disks UID:root 0660, and its read-only files (kernel,
// initrd, backing images, frozen layers) root's and readable by all
// (their directories stay root's alone on the host).
type Jail struct {
	// Helper is carreld's own binary; its main calls jail.Main first.
	Helper string
	// UIDBase is the first of UIDs users; default DefaultUIDBase.
	UIDBase uint32
	UIDs    uint32
}

// Default user range: 65536 ids at 0x60000000 (1610612736), far above
// the ids distributions give out and outside systemd's dynamic range
// (61184-65519). It lies inside systemd's container range
// (524288-1879048191), which systemd-nspawn draws from only for
// containers with private users: on such hosts choose another range
// (--jail-uid-base).
const (
	DefaultUIDBase = 0x60000000
	DefaultUIDs    = 1 << 16
)

// uids hands out jail users.
type uids struct {
	mu       sync.Mutex
	starting map[uint32]bool
}

// reserve picks the lowest user in j's range that no process runs as and
// no start in flight holds. release gives the hold back once the QEMU
// runs as it (or failed to).
func (u *uids) reserve(j *Jail) (uid uint32, release func(), err error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	used, err := procUIDs()
	if err != nil {
		return 0, nil, err
	}
	for i := uint32(0); i < j.UIDs; i++ {
		c := j.UIDBase + i
		if used[c] || u.starting[c] {
			continue
		}
		if u.starting == nil {
			u.starting = map[uint32]bool{}
		}
		u.starting[c] = true
		return c, func() {
			u.mu.Lock()
			delete(u.starting, c)
			u.mu.Unlock()
		}, nil
	}
	return 0, nil, fmt.Errorf("all %d jail users from %d are taken by running QEMUs", j.UIDs, j.UIDBase)
}

// procUIDs is every user a process runs as, from /proc/PID/status: not
// from /proc/PID's owner, which is root's for a process that made itself
// non-dumpable, as a hostile QEMU could, to have its user handed out
// again.
func procUIDs() (map[uint32]bool, error) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	used := map[uint32]bool{}
	for _, e := range ents {
		if e.Name()[0] < '0' || e.Name()[0] > '9' {
			continue
		}
		line, err := statusField(e.Name(), "Uid")
		if err != nil {
			continue // gone meanwhile
		}
		for _, f := range strings.Fields(line) { // real, effective, saved, fs
			if id, err := strconv.ParseUint(f, 10, 32); err == nil {
				used[uint32(id)] = true
			}
		}
	}
	return used, nil
}

// CheckUIDs refuses a range that /etc/passwd or /etc/group uses: a jail
// user must be no one else.
func (j *Jail) CheckUIDs() error {
	for _, f := range []string{"/etc/passwd", "/etc/group"} {
		b, err := os.ReadFile(f)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return err
		}
		sc := bufio.NewScanner(strings.NewReader(string(b)))
		for sc.Scan() {
			fields := strings.Split(sc.Text(), ":")
			if len(fields) < 3 {
				continue
			}
			id, err := strconv.ParseUint(fields[2], 10, 32)
			if err == nil && uint32(id) >= j.UIDBase && uint32(id)-j.UIDBase < j.UIDs {
				return fmt.Errorf("%s gives id %d to %q, inside the jail users %d-%d: choose another range", f, id, fields[0], j.UIDBase, j.UIDBase+j.UIDs-1)
			}
		}
	}
	return nil
}

// jailRootName is the empty directory, in the VM's directory, that the
// jail's tmpfs is mounted on inside its namespace.
const jailRootName = "jail"

// jailed returns the command that runs QEMU with argv in spec's jail as
// uid, having handed it its files.
func (d *Driver) jailed(spec driver.Spec, l layout, uid uint32, gpus gpuPlan, argv []string, keepFDs int) (*exec.Cmd, error) {
	j := d.cfg.Jail
	bin, err := d.binaryPath()
	if err != nil {
		return nil, err
	}
	dir := filepath.Clean(spec.Dir)
	root := filepath.Join(dir, jailRootName)
	if err := os.Mkdir(root, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, err
	}
	if err := handOver(dir, uid, spec); err != nil {
		return nil, fmt.Errorf("hand the vm's files to its jail user %d: %w", uid, err)
	}
	s := jail.Spec{Root: root, UID: uid, GID: uid, PIDFile: l.pidfile, KeepFDs: keepFDs, Argv: append([]string{bin}, argv...)}
	s.Binds = append([]jail.Bind{{Path: dir, Writable: true}}, jailBinds(dir, append([]string{bin, spec.Kernel, spec.Initrd}, diskFiles(spec)...))...)
	if d.cfg.Accelerator == "kvm" {
		s.Devices = append(s.Devices, "/dev/kvm")
	}
	if spec.CID != 0 {
		s.Devices = append(s.Devices, "/dev/vhost-vsock")
	}
	if len(gpus.args) > 0 {
		// VFIO: the container, each group's node (made the jail user's,
		// as libvirt does), and sysfs, where QEMU reads the devices.
		s.Devices = append(s.Devices, "/dev/vfio/vfio")
		for _, g := range gpus.groups {
			node := "/dev/vfio/" + strconv.Itoa(g)
			if err := os.Chown(node, int(uid), int(uid)); err != nil {
				return nil, fmt.Errorf("give %s to the vm's jail user: %w", node, err)
			}
			s.Devices = append(s.Devices, node)
		}
		s.Binds = append(s.Binds, jail.Bind{Path: "/sys"})
		s.MemlockBytes = spec.MemoryBytes + 1<<30
	}
	for _, dev := range s.Devices {
		g, err := deviceGroup(dev, uid)
		if err != nil {
			return nil, err
		}
		if g >= 0 && !slices.Contains(s.Groups, uint32(g)) {
			s.Groups = append(s.Groups, uint32(g))
		}
	}
	cmd, err := jail.Command(j.Helper, s)
	if err != nil {
		return nil, err
	}
	return cmd, nil
}

// diskFiles are every file a VM's disks are made of.
func diskFiles(spec driver.Spec) []string {
	var out []string
	for _, d := range spec.Disks {
		out = append(out, d.Path)
		out = append(out, d.Layers...)
		if d.Backing != "" {
			out = append(out, d.Backing)
		}
	}
	return out
}

// jailBinds are the binds that show files in the jail, read-only, each
// once, leaving out those that the VM's directory (dir, shown writable:
// its own permissions decide what QEMU may open there) or /usr show
// already.
func jailBinds(dir string, files []string) []jail.Bind {
	var binds []jail.Bind
	seen := map[string]bool{}
	for _, f := range files {
		f = filepath.Clean(f)
		if f == "" || seen[f] || within(f, dir) || within(f, "/usr") || within(f, "/nix/store") {
			continue
		}
		seen[f] = true
		binds = append(binds, jail.Bind{Path: f})
	}
	return binds
}

// within reports whether path is under dir.
func within(path, dir string) bool {
	return strings.HasPrefix(path, dir+"/")
}

// handOver gives uid what its QEMU opens: see Jail.
func handOver(dir string, uid uint32, spec driver.Spec) error {
	if err := os.Chown(dir, 0, int(uid)); err != nil {
		return err
	}
	if err := os.Chmod(dir, 0o710); err != nil {
		return err
	}
	readOnly := []string{spec.Kernel, spec.Initrd}
	for _, d := range spec.Disks {
		if d.ReadOnly {
			readOnly = append(readOnly, d.Path)
		} else if err := giveDisk(d.Path, uid); err != nil {
			return err
		}
		readOnly = append(readOnly, d.Layers...)
		if d.Backing != "" {
			readOnly = append(readOnly, d.Backing)
		}
	}
	for _, f := range readOnly {
		if err := readableByAll(f); err != nil {
			return err
		}
	}
	return nil
}

// giveDisk makes a writable disk uid's, and leaves it readable and
// writable by root's group: carreld reads the disks' headers (and makes
// overlays over them) without CAP_DAC_OVERRIDE, which its unit does not
// give it.
func giveDisk(path string, uid uint32) error {
	// Root's first: without CAP_FOWNER only a file's owner may chmod it,
	// and an earlier start may have given it to another user.
	if err := os.Chown(path, 0, 0); err != nil {
		return err
	}
	if err := os.Chmod(path, 0o660); err != nil {
		return err
	}
	return os.Chown(path, int(uid), 0)
}

// readableByAll makes f root's (a frozen layer an earlier QEMU wrote is
// its user's) and readable by anyone who can reach it.
func readableByAll(f string) error {
	var st syscall.Stat_t
	if err := syscall.Stat(f, &st); err != nil {
		return &os.PathError{Op: "stat", Path: f, Err: err}
	}
	if st.Uid != 0 || st.Gid != 0 {
		if err := os.Chown(f, 0, 0); err != nil {
			return err
		}
	}
	if mode := os.FileMode(st.Mode) & os.ModePerm; mode&0o444 != 0o444 || mode&0o222 != 0 {
		return os.Chmod(f, (mode|0o444)&^0o222)
	}
	return nil
}

// deviceGroup is the group the jail user uid needs to open dev
// read-write: -1 when it may as it is (the node is its own, as a VFIO
// group's is, or anyone's), else the node's group if that may.
func deviceGroup(dev string, uid uint32) (int, error) {
	var st syscall.Stat_t
	if err := syscall.Stat(dev, &st); err != nil {
		return 0, fmt.Errorf("the jail needs %s: %w", dev, err)
	}
	switch mode := st.Mode & 0o777; {
	case st.Uid == uid && mode&0o600 == 0o600, mode&0o006 == 0o006:
		return -1, nil
	case mode&0o060 == 0o060:
		return int(st.Gid), nil
	}
	return 0, fmt.Errorf("%s is open to neither its group nor all (mode %o): the jail's QEMU could not use it", dev, st.Mode&0o777)
}

// jailCaps are the capabilities carreld needs to jail QEMU: to build the
// namespaces and mounts (CAP_SYS_ADMIN), hand files over (CAP_CHOWN),
// empty the bounding set (CAP_SETPCAP) and change users.
var jailCaps = map[int]string{0: "CAP_CHOWN", 6: "CAP_SETGID", 7: "CAP_SETUID", 8: "CAP_SETPCAP", 21: "CAP_SYS_ADMIN"}

// CheckJail tries the jail once, with QEMU printing its version in it, so
// that a host (or a systemd unit) that cannot jail QEMU stops carreld
// with the reason, not every VM's start. A QEMU that runs in the jail and
// fails there is only logged: that is for each start to report. dir is an empty directory of
// root's for the try.
func (d *Driver) CheckJail(dir string) error {
	if d.cfg.Jail == nil {
		return nil
	}
	v, err := statusField("self", "CapEff")
	if err != nil {
		return err
	}
	eff, _ := strconv.ParseUint(v, 16, 64)
	var missing []string
	for bit, name := range jailCaps {
		if eff&(1<<bit) == 0 {
			missing = append(missing, name)
		}
	}
	if len(missing) > 0 {
		slices.Sort(missing)
		return fmt.Errorf("jailing qemu needs %s, which carreld lacks (its unit's CapabilityBoundingSet=)", strings.Join(missing, " "))
	}
	bin, err := d.binaryPath()
	if err != nil {
		return err
	}
	uid, release, err := d.uids.reserve(d.cfg.Jail)
	if err != nil {
		return err
	}
	defer release()
	root := filepath.Join(dir, jailRootName)
	if err := os.MkdirAll(root, 0o700); err != nil {
		return err
	}
	cmd, err := jail.Command(d.cfg.Jail.Helper, jail.Spec{Root: root, UID: uid, GID: uid, Binds: jailBinds(dir, []string{bin}), Argv: []string{bin, "-version"}})
	if err != nil {
		return err
	}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start the jail: %w", err)
	}
	timer := time.AfterFunc(10*time.Second, func() { _ = cmd.Process.Kill() })
	err = cmd.Wait()
	timer.Stop()
	msg := strings.TrimSpace(out.String())
	var exit *exec.ExitError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &exit) && exit.ExitCode() == jail.ExitSetup:
		return fmt.Errorf("qemu cannot be jailed here: %s", msg)
	}
	// The jail was built and QEMU ran in it, then failed: QEMU's own
	// trouble, which each VM's start reports.
	d.cfg.Logger.Warn("qemu -version failed in its jail", "err", err, "output", msg)
	return nil
}

// binaryPath is QEMU's binary by its absolute path, the one the jail
// shows.
func (d *Driver) binaryPath() (string, error) {
	bin, err := exec.LookPath(d.cfg.Binary)
	if err == nil {
		bin, err = filepath.Abs(bin)
	}
	if err != nil {
		return "", fmt.Errorf("find %s: %w", d.cfg.Binary, err)
	}
	return bin, nil
}

// statusField is the value of one line of /proc/PID/status.
func statusField(pid, name string) (string, error) {
	b, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		return "", err
	}
	_, rest, ok := strings.Cut("\n"+string(b), "\n"+name+":")
	if !ok {
		return "", fmt.Errorf("/proc/%s/status has no %s", pid, name)
	}
	line, _, _ := strings.Cut(rest, "\n")
	return strings.TrimSpace(line), nil
}
