//go:build linux

// Command carrel-agent is the in-guest agent: PID 1 of carrel's images, or
// the guest's agent under the image's own init (--system). It parses its
// flags and runs package guest-agent/agent, which says what it does.
package main

import (
	"context"
	"flag"
	"log/slog"
	"net"
	"os"
	"runtime/debug"

	"github.com/carrel-os/carrel/guest-agent/agent"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// gcPercent is the agent's GOGC unless the environment sets one. Each
// message of a file transfer is a fresh 1 MiB buffer, so at Go's default
// (100) and the agent's small live heap the collector runs every few
// messages and hands pages back that the next messages fault in again;
// in a guest, under TCG above all, that costs more than the few MiB of
// heap this keeps.
const gcPercent = 400

// wrapListener is the identity, except in the test build of the agent
// (build tag carrel_misbehave), where it lets the agent misbehave on
// purpose; see misbehave.go.
var wrapListener = func(l net.Listener, _ *slog.Logger) net.Listener { return l }

type options struct {
	transport  string
	vsockPort  uint
	serialName string
	listen     string
	// system: the guest's agent, run as a service of the image's init.
	system bool
	// mountState: set up the writable layer below this root, and exit.
	mountState string
}

func main() {
	// carrel-agent request ...: a program in the guest asking its host,
	// through the running agent.
	if len(os.Args) > 1 && os.Args[1] == "request" && os.Getpid() != 1 {
		os.Exit(request(os.Args[2:], os.Stdout, os.Stderr))
	}
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(gcPercent)
	}
	pid1 := os.Getpid() == 1
	log := agent.NewLogger(os.Stderr)

	var o options
	fs := flag.NewFlagSet("carrel-agent", flag.ContinueOnError)
	fs.StringVar(&o.transport, "transport", agent.Auto, "auto, vsock, serial, or unix (not as pid 1); auto prefers vsock")
	fs.UintVar(&o.vsockPort, "vsock-port", protocol.VsockPort, "vsock port to listen on")
	fs.StringVar(&o.serialName, "serial-name", protocol.SerialPortName, "name of the virtio-serial port")
	fs.StringVar(&o.listen, "listen", "", "unix socket path, for --transport unix")
	fs.BoolVar(&o.system, "system", false, "run as the guest's agent under the image's init system (a systemd service with Delegate=yes)")
	fs.StringVar(&o.mountState, "mount-state", "", "set up the VM's writable layer below this root (a systemd initrd's /sysroot), as carrel.state= says, and exit")
	if err := fs.Parse(os.Args[1:]); err != nil {
		if !pid1 {
			os.Exit(2)
		}
		// The kernel passes unknown command-line words to init; never die
		// over them.
		log.Warn("bad arguments; using defaults for the rest", "args", os.Args[1:], "err", err)
	}

	if o.mountState != "" && !pid1 {
		if err := agent.MountState(log, o.mountState); err != nil {
			os.Exit(1)
		}
		return
	}

	if o.transport == "" || !agent.KnownTransport(o.transport) {
		log.Error("unknown --transport; using auto", "transport", o.transport)
		if !pid1 {
			os.Exit(2)
		}
		o.transport = agent.Auto
	}

	err := agent.Run(context.Background(), agent.Config{
		Transport:    o.transport,
		VsockPort:    uint32(o.vsockPort),
		SerialName:   o.serialName,
		Listen:       o.listen,
		System:       o.system,
		PID1:         pid1,
		Logger:       log,
		WrapListener: wrapListener,
	})
	if err != nil {
		// Run has logged why (and, for a boot that failed, printed
		// protocol.BootFailedMarker).
		os.Exit(1)
	}
}
