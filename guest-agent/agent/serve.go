//go:build linux

package agent

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/carrel-os/carrel/guest-agent/egress"
	"github.com/carrel-os/carrel/guest-agent/exec"
	"github.com/carrel-os/carrel/guest-agent/files"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/guest-agent/reaper"
	"github.com/carrel-os/carrel/guest-agent/requests"
	"github.com/carrel-os/carrel/guest-agent/sandbox"
	"github.com/carrel-os/carrel/guest-agent/server"
	"github.com/carrel-os/carrel/guest-agent/tarfs"
	"github.com/carrel-os/carrel/guest-agent/transport"
	"github.com/carrel-os/carrel/guest-agent/user"
)

// serve listens on the chosen transport, prints the ready line, and serves
// until ctx ends or serving fails. powerOff is what a Shutdown call does
// once it has been answered.
func serve(ctx context.Context, cfg Config, sb *sandbox.Guard, w workspace, eg *egress.Service, rq *requests.Broker, powerOff func(reboot bool)) error {
	log := cfg.Logger
	guest := cfg.PID1 || cfg.System
	l, name, err := listen(ctx, log, cfg)
	if err != nil {
		return err
	}
	log.Info("listening", "transport", name, "addr", l.Addr())
	l = cfg.WrapListener(l, log)
	fmt.Printf("%s transport=%s\n", protocol.ReadyMarker, name)
	fopts := files.Options{Owner: fileOwner(log, guest), Sandbox: sb}
	if name == transport.Serial {
		// Bulk file content goes beside the agent's port where the VM
		// has the data port; without it (a VM from before it), in the
		// stream.
		dp, err := transport.OpenDataPort(protocol.DataPortName)
		if err != nil {
			log.Info("no data port: file content goes in the stream", "err", err)
		} else {
			defer dp.Close()
			fopts.Data = dp
		}
	}
	scfg := server.Config{
		Transport: name,
		DataPort:  fopts.Data != nil,
		Log:       log,
		PowerOff:  powerOff,
		Sandbox:   sb,
		Runner:    &exec.Runner{Reaper: reaper.Default(), Sandbox: sb, Cgroups: w.groups},
		Files:     files.New(fopts),
	}
	if w.activity != nil {
		scfg.Runner.OnStart = w.activity.Started
		scfg.Activity = w.activity.Serve
	}
	if guest {
		// The image's environment for every command (a spec's "env").
		env, err := exec.ReadEnvironment(exec.EnvironmentFile)
		if err != nil {
			log.Warn("image environment", "err", err)
		}
		scfg.Runner.Env = env
	}
	scfg.Requests = rq
	if eg != nil {
		scfg.Egress = eg
		scfg.Runner.Env = append(scfg.Runner.Env, egress.Env()...)
	}
	return server.Serve(ctx, l, scfg)
}

// fileOwner is who owns what the host puts in the guest: the agent user,
// whose commands must be able to use it. Off the guest (a development
// host), files belong to whoever runs the agent.
func fileOwner(log *slog.Logger, guest bool) *tarfs.Owner {
	if !guest {
		return nil
	}
	u, err := user.Files{}.Lookup("agent")
	if err != nil {
		log.Warn("no agent user: files from the host stay owned by root", "err", err)
		return nil
	}
	return &tarfs.Owner{UID: int(u.UID), GID: int(u.GID)}
}

// startRequests takes the guest's requests to the host (package requests)
// on their socket, for the agent's life; nil off the guest.
func startRequests(ctx context.Context, log *slog.Logger, guest bool) *requests.Broker {
	if !guest {
		return nil
	}
	rq := requests.New(log)
	go func() {
		if err := requests.ExposeSelf(requests.AgentPath); err != nil {
			log.Warn("carrel-agent is not runnable in the guest: programs cannot use carrel-agent request", "path", requests.AgentPath, "err", err)
		}
	}()
	go func() {
		if err := rq.Listen(ctx, requests.SocketPath); err != nil {
			log.Warn("no guest requests: their socket failed", "path", requests.SocketPath, "err", err)
		}
	}()
	return rq
}
