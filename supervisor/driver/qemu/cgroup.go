package qemu

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/supervisor/driver"
)

// Host limits through cgroup v2, where the host has it: each VM's QEMU is
// born (clone3 with CLONE_INTO_CGROUP) into a group of its own below
// carreld's cgroup, which systemd delegates to it (Delegate=yes in
// carreld.service), with memory.max, cpu.max and pids.max set from the
// VM's size. carreld itself moves to a "supervisor" leaf beside them, since
// cgroup v2 lets only leaves hold processes once controllers are enabled.
// Elsewhere (cgroup v1 or hybrid hosts, no delegation) QEMU's own -m and
// -smp are the limits, and carreld says so once.

// cgroupControllers are the controllers a VM's group needs.
var cgroupControllers = []string{"memory", "cpu", "pids"}

// hostCgroup is carreld's delegated cgroup, ready for VM groups.
type hostCgroup struct {
	base string // e.g. /sys/fs/cgroup/system.slice/carreld.service
}

// openHostCgroup prepares carreld's own cgroup (selfPath, as
// /proc/self/cgroup names it) under the cgroup v2 mount for VM groups. It
// fails, saying why, where that is not possible. isCgroup2 tells a cgroup
// v2 mount (statfs) and is replaced in tests.
func openHostCgroup(mount, selfPath string, isCgroup2 func(string) bool) (*hostCgroup, error) {
	if !isCgroup2(mount) {
		return nil, fmt.Errorf("%s is not a cgroup v2 hierarchy (cgroup v1 or hybrid host)", mount)
	}
	base := filepath.Join(mount, filepath.Clean("/"+selfPath))
	have, err := os.ReadFile(filepath.Join(base, "cgroup.controllers"))
	if err != nil {
		return nil, err
	}
	avail := strings.Fields(string(have))
	for _, c := range cgroupControllers {
		if !slices.Contains(avail, c) {
			return nil, fmt.Errorf("controller %s is not available to carreld's cgroup %s (have %q; run carreld with Delegate=yes)", c, base, strings.TrimSpace(string(have)))
		}
	}
	// Processes in base (carreld, and QEMUs an older carreld left there)
	// move to a leaf, or enabling controllers below base fails.
	leaf := filepath.Join(base, "supervisor")
	if err := os.Mkdir(leaf, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, err
	}
	procs, err := os.ReadFile(filepath.Join(base, "cgroup.procs"))
	if err != nil {
		return nil, err
	}
	sc := bufio.NewScanner(bytes.NewReader(procs))
	for sc.Scan() {
		pid := strings.TrimSpace(sc.Text())
		if pid == "" {
			continue
		}
		if err := os.WriteFile(filepath.Join(leaf, "cgroup.procs"), []byte(pid), 0); err != nil && !errors.Is(err, unix.ESRCH) {
			return nil, fmt.Errorf("move process %s to %s: %w", pid, leaf, err)
		}
	}
	enable := "+" + strings.Join(cgroupControllers, " +")
	if err := os.WriteFile(filepath.Join(base, "cgroup.subtree_control"), []byte(enable), 0); err != nil {
		return nil, fmt.Errorf("enable %s in %s: %w", enable, base, err)
	}
	return &hostCgroup{base: base}, nil
}

// selfCgroup returns this process's cgroup v2 path from /proc/self/cgroup
// (the "0::" line).
func selfCgroup() (string, error) {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if p, ok := strings.CutPrefix(line, "0::"); ok {
			return p, nil
		}
	}
	return "", errors.New("no cgroup v2 entry in /proc/self/cgroup")
}

func statfsIsCgroup2(path string) bool {
	var st unix.Statfs_t
	return unix.Statfs(path, &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC
}

// vmCgroupName is the group of the VM whose directory is dir.
func vmCgroupName(dir string) string { return "vm-" + filepath.Base(dir) }

// create makes the group for one VM and returns it open, for
// SysProcAttr.CgroupFD, and its path. A group left from an earlier run of
// the same VM is reused, its limits rewritten.
func (h *hostCgroup) create(name string, memory uint64, cpus uint32, accel string) (*os.File, string, error) {
	dir := filepath.Join(h.base, name)
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, "", err
	}
	// The same limits as the libvirt driver's (see driver.HostMemoryLimit).
	limits := [][2]string{
		{"memory.max", strconv.FormatUint(driver.HostMemoryLimit(memory, accel), 10)},
		{"cpu.max", fmt.Sprintf("%d %d", driver.CPUQuota(cpus), driver.CPUPeriod)},
		{"pids.max", strconv.FormatUint(256+16*uint64(cpus), 10)},
	}
	for _, kv := range limits {
		if err := os.WriteFile(filepath.Join(dir, kv[0]), []byte(kv[1]), 0); err != nil {
			return nil, "", fmt.Errorf("set %s in %s: %w", kv[0], dir, err)
		}
	}
	f, err := os.Open(dir)
	if err != nil {
		return nil, "", err
	}
	return f, dir, nil
}

// remove deletes a VM's group once its QEMU is gone; a group that still
// holds a process stays.
func removeCgroup(path string) error {
	if path == "" {
		return nil
	}
	if err := unix.Rmdir(path); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("remove cgroup %s: %w", path, err)
	}
	return nil
}
