// Package systemd is carreld's glue to systemd: readiness and status
// notifications (Type=notify), watchdog pings (WatchdogSec=) and socket
// activation. Outside systemd every call is a no-op.
package systemd

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"time"

	"github.com/coreos/go-systemd/v22/activation"
	"github.com/coreos/go-systemd/v22/daemon"
)

// Ready tells systemd that carreld is serving.
func Ready(status string) {
	notify(daemon.SdNotifyReady + "\nSTATUS=" + status)
}

// Status updates the status line `systemctl status` shows.
func Status(status string) {
	notify("STATUS=" + status)
}

// Stopping tells systemd that carreld is shutting down.
func Stopping() {
	notify(daemon.SdNotifyStopping)
}

func notify(state string) {
	if _, err := daemon.SdNotify(false, state); err != nil {
		slog.Warn("sd_notify failed", "subsystem", "systemd", "err", err)
	}
}

// Watchdog pings systemd's watchdog at half its interval until ctx ends.
// healthy is asked before each ping; a false answer withholds the ping, so
// systemd restarts a carreld whose main loop is wedged.
func Watchdog(ctx context.Context, healthy func() bool) {
	interval, err := daemon.SdWatchdogEnabled(false)
	if err != nil || interval <= 0 {
		return
	}
	t := time.NewTicker(interval / 2)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if healthy == nil || healthy() {
				notify(daemon.SdNotifyWatchdog)
			}
		}
	}
}

// Listener returns the socket systemd passed in (socket activation), or nil
// when carreld was not socket-activated.
func Listener() (net.Listener, error) {
	ls, err := activation.Listeners()
	if err != nil {
		return nil, fmt.Errorf("socket activation: %w", err)
	}
	for _, l := range ls {
		if l != nil {
			return l, nil
		}
	}
	return nil, nil
}
