//go:build linux

package agent

import (
	"log/slog"
	"os"

	"github.com/carrel-os/carrel/guest-agent/activity"
	"github.com/carrel-os/carrel/guest-agent/cgroups"
	"github.com/carrel-os/carrel/guest-agent/exec"
	"github.com/carrel-os/carrel/guest-agent/initsys"
)

// workspace is how commands are grouped and watched; both parts may be
// nil.
type workspace struct {
	groups   *cgroups.Dir
	activity *activity.Monitor
}

// watchWorkspace gives each command a cgroup of its own (as PID 1, which
// owns the hierarchy, or as a service in the subtree its init delegated)
// and starts the watch of what commands do in the workspace (as root).
// What cannot be had is logged and done without.
func watchWorkspace(log *slog.Logger, pid1, system bool) workspace {
	var w workspace
	if pid1 || system {
		open := func() (*cgroups.Dir, error) { return cgroups.Open(cgroups.Mount, "carrel") }
		if !pid1 {
			open = func() (*cgroups.Dir, error) { return cgroups.OpenDelegated(cgroups.Mount) }
		}
		d, err := open()
		if err != nil {
			log.Warn("commands get no cgroup of their own", "err", err)
		} else {
			w.groups = d
			// The limit carreld set is applied to all commands together.
			if l, _ := initsys.ReadLimits(); l.MaxProcesses > 0 {
				if err := d.SetMaxProcesses(l.MaxProcesses); err != nil {
					log.Error("process limit not applied", "max", l.MaxProcesses, "err", err)
				} else {
					log.Info("process limit applied", "max", l.MaxProcesses)
				}
			}
		}
	}
	if os.Geteuid() != 0 {
		log.Info("not root: the workspace's activity is not watched")
		return w
	}
	opts := activity.Options{Root: exec.DefaultDir, Log: log}
	if w.groups != nil {
		opts.Cgroup = w.groups.ExecID
	}
	m, err := activity.Start(opts)
	if err != nil {
		log.Warn("the workspace's activity is not watched", "err", err)
		return w
	}
	w.activity = m
	return w
}
