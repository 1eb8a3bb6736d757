// Package libvirttest gets a real libvirtd for tests of the libvirt
// driver: on build and CI machines nothing starts services, so the tests
// start virtlogd and libvirtd themselves when their sockets are absent.
package libvirttest

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Socket is the system libvirtd's read-write socket (qemu:///system).
const Socket = "/var/run/libvirt/libvirt-sock"

const virtlogdSocket = "/var/run/libvirt/virtlogd-sock"

// ErrUnavailable means libvirtd cannot be had here: its binaries are
// missing, or the caller is not root. Tests skip on it.
var ErrUnavailable = errors.New("libvirtd unavailable")

// Ensure makes sure the system libvirtd answers on Socket, starting
// virtlogd and libvirtd (daemonized, left running for later tests) when
// their sockets do not answer. It installs nothing: without the binaries
// (apt-get install libvirt-daemon-system, or `make deps`) it returns
// ErrUnavailable.
func Ensure() error {
	if err := kvmForGroup(); err != nil {
		return err
	}
	if answers(Socket) {
		return nil
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("%w: not running as root, and libvirtd does not answer on %s", ErrUnavailable, Socket)
	}
	libvirtd, err := exec.LookPath("libvirtd")
	if err != nil {
		return fmt.Errorf("%w: libvirtd is not installed (apt-get install libvirt-daemon-system, or make deps)", ErrUnavailable)
	}
	virtlogd, err := exec.LookPath("virtlogd")
	if err != nil {
		return fmt.Errorf("%w: virtlogd is not installed (apt-get install libvirt-daemon-system, or make deps)", ErrUnavailable)
	}
	for _, d := range []string{"/var/log/libvirt", "/var/run/libvirt"} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	if !answers(virtlogdSocket) {
		if out, err := exec.Command(virtlogd, "-d").CombinedOutput(); err != nil {
			return fmt.Errorf("start virtlogd: %v: %s", err, out)
		}
		if err := await(virtlogdSocket, 10*time.Second); err != nil {
			return fmt.Errorf("virtlogd: %w", err)
		}
	}
	if out, err := exec.Command(libvirtd, "-d").CombinedOutput(); err != nil {
		return fmt.Errorf("start libvirtd: %v: %s", err, out)
	}
	if err := await(Socket, 30*time.Second); err != nil {
		return fmt.Errorf("libvirtd: %w", err)
	}
	return nil
}

func answers(socket string) bool {
	c, err := net.DialTimeout("unix", socket, time.Second)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

func await(socket string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for !answers(socket) {
		if time.Now().After(deadline) {
			return fmt.Errorf("%s does not answer after %s", socket, timeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return nil
}

// kvmForGroup does for /dev/kvm what Debian's udev rule does (group kvm,
// mode 0660), on machines without udev where it stays root's, mode 0600.
// There libvirtd probes QEMU as root and finds KVM, but then checks that
// the user QEMU runs as (libvirt-qemu, in group kvm) can open /dev/kvm,
// finds it cannot, takes its cached capabilities for stale and probes
// again, on every lookup: a domain then takes minutes to start.
func kvmForGroup() error {
	var st unix.Stat_t
	if err := unix.Stat("/dev/kvm", &st); err != nil || st.Uid != 0 || st.Gid != 0 || st.Mode&0o077 != 0 {
		return nil // absent, or already set up
	}
	g, err := user.LookupGroup("kvm")
	if err != nil || os.Geteuid() != 0 {
		return nil
	}
	gid, err := strconv.Atoi(g.Gid)
	if err != nil {
		return nil
	}
	if err := os.Chown("/dev/kvm", 0, gid); err != nil {
		return fmt.Errorf("give /dev/kvm to group kvm: %w", err)
	}
	if err := os.Chmod("/dev/kvm", 0o660); err != nil {
		return fmt.Errorf("chmod /dev/kvm: %w", err)
	}
	return nil
}

// Limits are the host limits libvirt put on a domain's QEMU, read from
// the domain's cgroup.
type Limits struct {
	// MemoryBytes is memory.limit_in_bytes (cgroup v1) or memory.max (v2).
	MemoryBytes uint64
	// CPUQuota and CPUPeriod are cpu.cfs_quota_us and cpu.cfs_period_us
	// (v1) or cpu.max (v2), in µs; CPUQuota is -1 when unlimited.
	CPUQuota, CPUPeriod int64
	// MemoryGroup and CPUGroup are the directories they were read from.
	MemoryGroup, CPUGroup string
}

// ReadLimits reads the limits of the domain whose QEMU runs as pid. libvirt
// keeps QEMU's threads in subgroups (emulator, vcpuN) of the domain's
// group, which holds the domain's limits; ReadLimits reads them there, on
// whichever hierarchy (v1 or v2) has the controller.
func ReadLimits(pid int) (Limits, error) {
	mounts, err := cgroupMounts()
	if err != nil {
		return Limits{}, err
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return Limits{}, err
	}
	group := func(controller string) (string, error) {
		for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
			parts := strings.SplitN(line, ":", 3)
			if len(parts) != 3 {
				continue
			}
			mount := ""
			if parts[0] == "0" && parts[1] == "" {
				if c, err := os.ReadFile(filepath.Join(mounts.unified, "cgroup.controllers")); err == nil && mounts.unified != "" && slices.Contains(strings.Fields(string(c)), controller) {
					mount = mounts.unified
				}
			} else if slices.Contains(strings.Split(parts[1], ","), controller) {
				mount = mounts.v1[parts[1]]
			}
			if mount != "" {
				return filepath.Join(mount, strings.TrimSuffix(parts[2], "/emulator")), nil
			}
		}
		return "", fmt.Errorf("process %d is in no cgroup with the %s controller", pid, controller)
	}
	var l Limits
	if l.MemoryGroup, err = group("memory"); err != nil {
		return l, err
	}
	if l.CPUGroup, err = group("cpu"); err != nil {
		return l, err
	}
	read := func(dir, name string) (string, error) {
		b, err := os.ReadFile(filepath.Join(dir, name))
		return strings.TrimSpace(string(b)), err
	}
	if s, err := read(l.MemoryGroup, "memory.limit_in_bytes"); err == nil {
		l.MemoryBytes, err = strconv.ParseUint(s, 10, 64)
		if err != nil {
			return l, err
		}
	} else if s, err := read(l.MemoryGroup, "memory.max"); err == nil {
		if s == "max" {
			l.MemoryBytes = 1<<64 - 1
		} else if l.MemoryBytes, err = strconv.ParseUint(s, 10, 64); err != nil {
			return l, err
		}
	} else {
		return l, err
	}
	if q, err := read(l.CPUGroup, "cpu.cfs_quota_us"); err == nil {
		p, err := read(l.CPUGroup, "cpu.cfs_period_us")
		if err != nil {
			return l, err
		}
		if l.CPUQuota, err = strconv.ParseInt(q, 10, 64); err != nil {
			return l, err
		}
		if l.CPUPeriod, err = strconv.ParseInt(p, 10, 64); err != nil {
			return l, err
		}
	} else if s, err := read(l.CPUGroup, "cpu.max"); err == nil {
		q, p, _ := strings.Cut(s, " ")
		if l.CPUPeriod, err = strconv.ParseInt(p, 10, 64); err != nil {
			return l, fmt.Errorf("cpu.max %q: %w", s, err)
		}
		l.CPUQuota = -1
		if q != "max" {
			if l.CPUQuota, err = strconv.ParseInt(q, 10, 64); err != nil {
				return l, fmt.Errorf("cpu.max %q: %w", s, err)
			}
		}
	} else {
		return l, err
	}
	return l, nil
}

type mounts struct {
	unified string            // the cgroup v2 mount, if any
	v1      map[string]string // v1 mounts by their controllers as /proc/PID/cgroup lists them ("cpu,cpuacct")
}

// cgroupMounts reads the cgroup mounts from /proc/self/mountinfo.
func cgroupMounts() (mounts, error) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return mounts{}, err
	}
	m := mounts{v1: map[string]string{}}
	for _, line := range strings.Split(string(b), "\n") {
		pre, post, ok := strings.Cut(line, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if !ok || len(f) < 5 || len(g) < 3 {
			continue
		}
		switch g[0] {
		case "cgroup2":
			m.unified = f[4]
		case "cgroup":
			var ctrls []string
			for _, o := range strings.Split(g[2], ",") {
				if o != "rw" && o != "ro" && !strings.Contains(o, "=") && o != "clone_children" && o != "noprefix" && o != "xattr" {
					ctrls = append(ctrls, o)
				}
			}
			m.v1[strings.Join(ctrls, ",")] = f[4]
		}
	}
	return m, nil
}
