package libvirt

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// ErrNoSandbox means QEMU runs without its seccomp filter.
var ErrNoSandbox = errors.New("qemu runs without its seccomp sandbox: set seccomp_sandbox = 1 in /etc/libvirt/qemu.conf and restart libvirtd")

// qemuPID reads the pid of a domain's QEMU from the pid file libvirtd
// keeps in runDir, and checks that the process is that domain's QEMU
// (libvirt names it with -name guest=NAME).
func qemuPID(runDir, domain string) (int, error) {
	path := filepath.Join(runDir, domain+".pid")
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, fmt.Errorf("read qemu pid file: %w", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return 0, fmt.Errorf("qemu pid file %s holds %q", path, b)
	}
	cmdline, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	if err != nil {
		return 0, fmt.Errorf("qemu %d of domain %s: %w", pid, domain, err)
	}
	if !bytes.Contains(cmdline, []byte("guest="+domain+",")) && !bytes.Contains(cmdline, []byte("\x00guest="+domain+"\x00")) {
		return 0, fmt.Errorf("process %d is not the qemu of domain %s", pid, domain)
	}
	return pid, nil
}

// seccompMode is the Seccomp field of /proc/PID/status: 0 none, 1 strict,
// 2 filter.
func seccompMode(pid int) (int, error) {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "Seccomp:"); ok {
			return strconv.Atoi(strings.TrimSpace(v))
		}
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("/proc/%d/status has no Seccomp field", pid)
}

// checkSandbox fails unless QEMU has a seccomp filter (libvirt passes
// -sandbox on,... when qemu.conf's seccomp_sandbox is 1, its default).
func checkSandbox(pid int) error {
	mode, err := seccompMode(pid)
	if err != nil {
		return fmt.Errorf("check qemu %d's seccomp sandbox: %w", pid, err)
	}
	if mode != 2 {
		return fmt.Errorf("%w (qemu %d has seccomp mode %d)", ErrNoSandbox, pid, mode)
	}
	return nil
}
