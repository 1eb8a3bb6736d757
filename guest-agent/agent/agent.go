//go:build linux

// Package agent wires the in-guest agent together: the system set-up, the
// console and signals, the sandbox, the cgroups and the workspace's
// activity watch, the egress proxies, and the serving of the agent API to
// the host (package server), retried as long as the agent must stay up.
//
// In carrel's images the agent is the initramfs's PID 1 (/init): it sets the
// system up, mounts the image's verified root and switches to it, then
// serves the agent API to the host over vsock or virtio-serial. In an image
// that brings its own init (systemd), it runs as a service (Config.System):
// the init system does PID 1's work, and the agent serves, runs the egress
// proxies, gives each command a cgroup in the subtree the service was
// delegated, and powers off through the init system. In an image whose
// initrd is systemd's (the NixOS guest), MountState sets the VM's writable
// layer up there. Run as any other pid without System (on a development
// host) it only serves, and can listen on a unix socket.
//
// Every command it starts runs with no_new_privs, and, once the host has
// set a sandbox (SetSandbox), inside a Landlock domain where the kernel has
// Landlock; the file service then keeps to the sandbox's roots. The agent
// itself is never confined. As PID 1 it starts each command in a cgroup of
// its own; as root it watches what commands do in /workspace (package
// activity) for the host's Activity call.
//
// The lines carreld and the end-to-end tests read are printed here:
// protocol.ReadyMarker on stdout once the agent listens, and
// protocol.BootFailedMarker on stderr when the boot fails.
package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/guest-agent/initsys"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/guest-agent/reaper"
	"github.com/carrel-os/carrel/guest-agent/sandbox"
	"github.com/carrel-os/carrel/guest-agent/server"
	"github.com/carrel-os/carrel/guest-agent/transport"
)

// Auto is the transport that prefers vsock and falls back to
// virtio-serial (transport.Detect).
const Auto = "auto"

// Config is what carrel-agent's flags give Run.
type Config struct {
	// Transport is Auto, transport.Vsock, transport.Serial (or its short
	// name "serial"), or transport.Unix (not as PID 1, and with Listen).
	// Empty means Auto. See KnownTransport.
	Transport string
	// VsockPort is the vsock port to listen on (protocol.VsockPort in
	// carrel's VMs).
	VsockPort uint32
	// SerialName is the name of the virtio-serial port
	// (protocol.SerialPortName in carrel's VMs).
	SerialName string
	// Listen is the unix socket path for transport.Unix.
	Listen string
	// System runs the agent as the guest's agent under the image's init
	// system: a systemd service with Delegate=yes.
	System bool
	// PID1 is whether the agent is the guest's init; the caller knows
	// (os.Getpid() == 1) and tests may not be.
	PID1 bool
	// Logger is the agent's log; nil means slog.Default().
	Logger *slog.Logger
	// WrapListener, when set, wraps each listener before the agent serves
	// on it; the test build of carrel-agent uses it to misbehave. nil
	// means the listener is served as it is.
	WrapListener func(net.Listener, *slog.Logger) net.Listener
}

// KnownTransport reports whether name is a Config.Transport that Run
// accepts.
func KnownTransport(name string) bool {
	switch name {
	case "", Auto, transport.Vsock, "serial", transport.Serial, transport.Unix:
		return true
	}
	return false
}

// Run sets the agent up as cfg says and serves the agent API to the host.
//
// Run returns nil when ctx ends, off PID 1 when the agent gets SIGINT or
// SIGTERM, and, off the guest (neither PID1 nor System), once a Shutdown
// call has been answered. As PID 1 it ignores those signals and never
// stops serving: serving that fails is retried, since PID 1's exit panics
// the kernel. It returns an error only when the agent must exit: a boot
// that fails (a verified root or a workspace that cannot be set up, as
// PID 1; a workspace that is not there, as System), or, off PID 1, serving
// that fails. Run has logged the reason for any error it returns, and for
// a boot that fails as PID 1 printed protocol.BootFailedMarker on stderr;
// the caller need only exit with status 1.
func Run(ctx context.Context, cfg Config) error {
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
		cfg.Logger = log
	}
	if !KnownTransport(cfg.Transport) {
		return fmt.Errorf("unknown transport %q", cfg.Transport)
	}
	if cfg.Transport == "" {
		cfg.Transport = Auto
	}
	if cfg.WrapListener == nil {
		cfg.WrapListener = func(l net.Listener, _ *slog.Logger) net.Listener { return l }
	}

	if cfg.PID1 {
		if err := initsys.Setup(log); err != nil {
			log.Error("setup", "err", err)
			if errors.Is(err, initsys.ErrWorkspace) || errors.Is(err, initsys.ErrRoot) {
				// Fail the boot (the kernel panics when PID 1 exits), with
				// the reason on the console, rather than serve from a
				// root that failed verification, or a workspace in memory
				// that carreld did not give the VM.
				fmt.Fprintf(os.Stderr, "%s %v\n", protocol.BootFailedMarker, err)
				return err
			}
		}
		if err := useConsole(); err != nil {
			log.Error("open console", "err", err)
		}
		ignoreSignals(log)
	} else {
		if cfg.System {
			if err := initsys.Service(log); err != nil {
				// The workspace carreld gave the VM is not there: do not
				// serve one in the root instead. systemd restarts us.
				log.Error("setup", "err", err)
				return err
			}
		}
		var stop context.CancelFunc
		ctx, stop = signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
		defer stop()
		// Orphans of our commands come back to us, as they would to PID 1.
		_ = unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
	}
	// Off the guest, a Shutdown ends Run instead of powering off.
	ctx, exit := context.WithCancel(ctx)
	defer exit()

	// The guest's agent, whether PID 1 or its init's service: it gives
	// commands the guest's network (the egress proxies), the image's
	// environment and the agent user's files.
	guest := cfg.PID1 || cfg.System
	reaper.Default()
	log.Info("starting", "version", server.Version, "pid1", cfg.PID1, "system", cfg.System, "transport", cfg.Transport)
	if guest {
		// Here, past any exec of the image's own init (initsys.Setup).
		if tid, err := slowSysmon(); err != nil {
			log.Warn("cannot set the runtime's sysmon thread's timer slack", "tid", tid, "err", err)
		}
	}
	if abi, err := sandbox.ABI(); err != nil {
		log.Warn("no Landlock: commands will run with no_new_privs only", "err", err)
	} else {
		log.Info("landlock available", "abi", abi)
	}
	// One sandbox for the agent's life: it outlives a serve that fails.
	sb := &sandbox.Guard{Log: log}
	w := watchWorkspace(log, cfg.PID1, cfg.System)
	eg := startEgress(ctx, log, guest)
	rq := startRequests(ctx, log, guest)
	off := func(reboot bool) { powerOff(log, cfg.PID1, cfg.System, reboot, exit) }

	backoff := time.Second
	for {
		err := serve(ctx, cfg, sb, w, eg, rq, off)
		if ctx.Err() != nil {
			return nil
		}
		if err == nil {
			continue // only after a Shutdown whose power-off returned
		}
		if !cfg.PID1 {
			log.Error("serve", "err", err)
			return err
		}
		// PID 1 exiting panics the kernel: keep trying.
		log.Error("serve; retrying", "err", err, "in", backoff)
		time.Sleep(backoff)
		backoff = min(2*backoff, 10*time.Second)
	}
}

// MountState sets the VM's writable layer up below root (a systemd
// initrd's /sysroot), as the kernel command line's carrel.state= says
// (initsys.MountState). On failure it logs the reason and prints
// protocol.BootFailedMarker with it on stderr, and the boot should fail.
func MountState(log *slog.Logger, root string) error {
	if err := initsys.MountState(log, root); err != nil {
		log.Error("writable layer", "err", err)
		fmt.Fprintf(os.Stderr, "%s %v\n", protocol.BootFailedMarker, err)
		return err
	}
	return nil
}
