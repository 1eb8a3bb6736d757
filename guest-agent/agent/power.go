//go:build linux

package agent

import (
	"log/slog"
	osexec "os/exec"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/guest-agent/initsys"
)

// powerOff is what a Shutdown call does once it has been answered: as
// System, ask the init system (or, without systemctl, power off
// directly); as PID 1, power off or reboot; off the guest, call exit,
// which ends Run. It returns if powering off failed.
func powerOff(log *slog.Logger, pid1, system, reboot bool, exit func()) {
	if system && !pid1 {
		// The init system stops the services, unmounts and powers off.
		verb := "poweroff"
		if reboot {
			verb = "reboot"
		}
		out, err := osexec.Command("systemctl", "--no-block", verb).CombinedOutput()
		log.Info("asked the init system to power off", "verb", verb, "err", err, "output", strings.TrimSpace(string(out)))
		if err == nil {
			return
		}
		// No systemctl: sync and do it ourselves.
		unix.Sync()
		cmd := unix.LINUX_REBOOT_CMD_POWER_OFF
		if reboot {
			cmd = unix.LINUX_REBOOT_CMD_RESTART
		}
		log.Error("power off", "err", unix.Reboot(cmd))
		return
	}
	if !pid1 {
		log.Info("not pid 1: exiting instead of powering off", "reboot", reboot)
		exit()
		return
	}
	var err error
	if reboot {
		err = initsys.Reboot(log)
	} else {
		err = initsys.PowerOff(log)
	}
	log.Error("power off", "err", err)
}
