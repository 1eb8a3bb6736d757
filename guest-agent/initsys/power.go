//go:build linux

package initsys

import (
	"log/slog"
	"os"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

const (
	// termGrace is how long processes get between SIGTERM and SIGKILL.
	termGrace = 2 * time.Second
	// rebootFallback is how long to wait for power-off before restarting
	// instead (QEMU runs with -no-reboot, so a restart also ends it).
	rebootFallback = 2 * time.Second
)

// PowerOff stops every process, syncs, and powers the machine off. It
// returns only ErrNotInit; otherwise it does not return.
func PowerOff(log *slog.Logger) error { return halt(log, unix.LINUX_REBOOT_CMD_POWER_OFF) }

// Reboot is PowerOff, but restarts the machine.
func Reboot(log *slog.Logger) error { return halt(log, unix.LINUX_REBOOT_CMD_RESTART) }

func halt(log *slog.Logger, cmd int) error {
	if os.Getpid() != 1 {
		return ErrNotInit
	}
	killAll(log)
	unix.Sync()
	go func() {
		time.Sleep(rebootFallback)
		log.Error("still running after reboot(2); restarting")
		unix.Reboot(unix.LINUX_REBOOT_CMD_RESTART)
	}()
	if err := unix.Reboot(cmd); err != nil {
		log.Error("reboot(2) failed", "cmd", cmd, "err", err)
	}
	select {} // PID 1 must not exit: that panics the kernel
}

// killAll sends SIGTERM to every process but us, waits up to termGrace for
// them to go, then sends SIGKILL.
func killAll(log *slog.Logger) {
	unix.Kill(-1, unix.SIGTERM)
	deadline := time.Now().Add(termGrace)
	for time.Now().Before(deadline) && userProcesses() > 0 {
		time.Sleep(20 * time.Millisecond)
	}
	if n := userProcesses(); n > 0 {
		log.Warn("processes left after SIGTERM; killing", "count", n)
	}
	unix.Kill(-1, unix.SIGKILL)
}

// userProcesses counts live processes other than this one. Kernel threads
// and zombies have no /proc/<pid>/exe.
func userProcesses() int {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0
	}
	self := os.Getpid()
	n := 0
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		if _, err := os.Readlink("/proc/" + e.Name() + "/exe"); err == nil {
			n++
		}
	}
	return n
}
