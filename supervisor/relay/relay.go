// Package relay carries calls from carreld's API to the guest agents and
// back: the agent's file, process and port services, served on carreld's
// socket for the VM that protocol.VMHeader names.
//
// Every operation bound for a guest is decided by its VM's policy (Decide)
// and, when it acts, its intent is made durable by the recorder before the
// guest sees it. Everything the guest sends back is checked (size caps,
// shapes, the agent's alphabets) before it is recorded and passed on. The
// relays return carreld's own errors as they found them, for the API to
// map to connect codes; an error the guest sent keeps only a code it may
// give and a cleaned message (GuestError).
package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/supervisor/agentlink"
	"github.com/carrel-os/carrel/supervisor/recorder"
)

// VMs finds what a relay needs of a running VM: the link to its agent
// and its current session. *vm.Manager is one.
type VMs interface {
	Link(name string) (*agentlink.Link, error)
	SessionOf(name string) string
	// EnvOf is the environment every command in the VM gets, under the
	// command's own (vm.CreateParams.Env).
	EnvOf(name string) []string
}

// Config wires the relays.
type Config struct {
	VMs VMs
	// Decide decides one operation with its VM's policy; an error is the
	// denial. Nil allows everything (unit tests of the relays alone).
	Decide func(ctx context.Context, in policy.Input) error
	// Caller names who made the call in ctx; nil means an anonymous peer.
	Caller func(ctx context.Context) policy.Caller
	// Recorder writes the audit records; nil records nothing.
	Recorder *recorder.Recorder
	Logger   *slog.Logger
}

// Relay serves the guest services on carreld's socket.
type Relay struct {
	cfg Config
}

// New returns the relays for cfg.
func New(cfg Config) *Relay {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Relay{cfg: cfg}
}

// Files is the guest's FileService, relayed.
func (r *Relay) Files() agentv1connect.FileServiceHandler { return fileRelay{r} }

// Agent is the guest's AgentService, relayed.
func (r *Relay) Agent() agentv1connect.AgentServiceHandler { return agentRelay{r} }

// Ports is the guest's PortService, relayed.
func (r *Relay) Ports() agentv1connect.PortServiceHandler { return portRelay{r} }

// vmOf names the VM a relayed call is for.
func vmOf(h http.Header) (string, error) {
	name := h.Get(protocol.VMHeader)
	if name == "" {
		return "", connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("name the vm in the %s header", protocol.VMHeader))
	}
	return name, nil
}

// link returns the agent link of the running VM a relayed call names.
func (r *Relay) link(h http.Header) (*agentlink.Link, error) {
	name, err := vmOf(h)
	if err != nil {
		return nil, err
	}
	return r.cfg.VMs.Link(name)
}

// call starts the audit records of one call for vm.
func (r *Relay) call(ctx context.Context, vm string) *recorder.Call {
	if r.cfg.Recorder == nil {
		return nil
	}
	session := ""
	if vm != "" && r.cfg.VMs != nil {
		session = r.cfg.VMs.SessionOf(vm)
	}
	return r.cfg.Recorder.Call(vm, session, r.caller(ctx))
}

func (r *Relay) caller(ctx context.Context) policy.Caller {
	if r.cfg.Caller == nil {
		return policy.Caller{Type: policy.CallerPeer}
	}
	return r.cfg.Caller(ctx)
}

func (r *Relay) decide(ctx context.Context, in policy.Input) error {
	if r.cfg.Decide == nil {
		return nil
	}
	return r.cfg.Decide(ctx, in)
}

// relayErr reports err to the link, which ends the connection when the
// guest broke the protocol. An error the guest sent is rebuilt
// (GuestError). A reply the relay refused (DataLoss) or a message over a
// size cap (ResourceExhausted) is passed on as it is. A call that carreld
// ended because it paused the VM (agentlink.ErrHeld) is Unavailable, and
// says why. Any other, unless the caller gave up, means the link broke
// under the call (a lost connection, a stream cut mid-message): that is
// Unavailable too, whatever code the transport chose, and the next call
// reconnects.
func relayErr(ctx context.Context, done func(context.Context, error) error, err error) error {
	if err == nil {
		return nil
	}
	err = done(ctx, err)
	switch {
	case connect.IsWireError(err):
		return GuestError(err)
	case ctx.Err() != nil, agentlink.IsHostError(err):
		return err
	case errors.Is(err, agentlink.ErrHeld):
		if ce, ok := err.(*connect.Error); ok && ce.Code() == connect.CodeUnavailable {
			return ce // refused before it reached the guest: as it is
		}
		return connect.NewError(connect.CodeUnavailable, err)
	}
	switch connect.CodeOf(err) {
	case connect.CodeDataLoss, connect.CodeResourceExhausted:
		return err
	}
	return connect.NewError(connect.CodeUnavailable, fmt.Errorf(
		"the link to the guest agent broke during the call (%v); carreld reconnects on the next call", err))
}

// errGuest is a reply that breaks the protocol's rules.
func errGuest(format string, args ...any) error {
	return connect.NewError(connect.CodeDataLoss, fmt.Errorf("guest agent: "+format, args...))
}
