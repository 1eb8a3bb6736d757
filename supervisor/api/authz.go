package api

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/policy"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
	"github.com/carrel-os/carrel/supervisor/gen/apiv1/apiv1connect"
	"github.com/carrel-os/carrel/supervisor/identity"
	"github.com/carrel-os/carrel/supervisor/policystore"
	"github.com/carrel-os/carrel/supervisor/recorder"
)

// authzInterceptor authenticates every call and has policy decide it
// before any handler runs. The decision is made by the policy of the VM
// the call names, or by the "default" policy for calls that name none.
type authzInterceptor struct{ cfg Config }

func (a authzInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (_ connect.AnyResponse, err error) {
		msg, _ := req.Any().(proto.Message)
		call := recorder.NewAPICall(req.Spec().Procedure)
		defer func() { a.ended(ctx, call, err) }()
		ctx, err = a.authorize(ctx, call, req.Header().Get(protocol.VMHeader), req.Header(), msg)
		if err != nil {
			return nil, err
		}
		return next(ctx, req)
	}
}

func (authzInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (a authzInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) (err error) {
		proc := conn.Spec().Procedure
		if heldUntilIntent[proc] && a.cfg.Recorder != nil {
			ctx = recorder.Hold(ctx)
		}
		call := recorder.NewAPICall(proc)
		defer func() { a.ended(ctx, call, err) }()
		if proc == apiv1connect.VMServiceExecProcedure {
			// The VM is in the request message, which has not arrived yet:
			// decide when the handler receives it, before it acts on it.
			// The caller is known now, from the headers, and the handler
			// gets it (its exec decision and intent name it).
			if a.cfg.Policies != nil {
				caller, err := identity.Authenticate(ctx, conn.RequestHeader(), a.cfg.Tokens)
				if err != nil {
					return connect.NewError(connect.CodeUnauthenticated, err)
				}
				ctx = identity.WithCaller(ctx, caller)
			}
			return next(ctx, &authorizeOnReceive{StreamingHandlerConn: conn, a: a, ctx: &ctx, call: call})
		}
		ctx, err = a.authorize(ctx, call, conn.RequestHeader().Get(protocol.VMHeader), conn.RequestHeader(), nil)
		if err != nil {
			return err
		}
		return next(ctx, conn)
	}
}

// agentServicePrefix begins the procedures relayed to a guest, which
// name their VM in the Carrel-Vm header.
const agentServicePrefix = "carrel.agent.v1."

// heldUntilIntent are the calls whose decisions become durable with the
// command's intent, in one group commit, and whose outcome with the
// api.call record: the routes of a command, which write the intent (or,
// for an attach, flush) before the guest sees anything (relay.run).
var heldUntilIntent = map[string]bool{
	apiv1connect.VMServiceExecProcedure:         true,
	agentv1connect.AgentServiceExecProcedure:    true,
	agentv1connect.AgentServiceProcessProcedure: true,
}

// unfenced are the calls a fenced VM still takes: to read about it,
// stop it and delete it.
var unfenced = map[string]bool{
	apiv1connect.VMServiceGetVMProcedure:            true,
	apiv1connect.VMServiceListVMsProcedure:          true,
	apiv1connect.VMServiceStopVMProcedure:           true,
	apiv1connect.VMServiceDeleteVMProcedure:         true,
	apiv1connect.VMServiceGetConsoleProcedure:       true,
	apiv1connect.VMServiceListSnapshotsProcedure:    true,
	apiv1connect.VMServiceListAuditRecordsProcedure: true,
}

// authorizeOnReceive decides a server-streaming call on its request.
type authorizeOnReceive struct {
	connect.StreamingHandlerConn
	a    authzInterceptor
	ctx  *context.Context
	call *recorder.APICall
	done bool
}

func (c *authorizeOnReceive) Receive(m any) error {
	if err := c.StreamingHandlerConn.Receive(m); err != nil {
		return err
	}
	if c.done {
		return nil
	}
	c.done = true
	msg, _ := m.(proto.Message)
	_, err := c.a.authorize(*c.ctx, c.call, c.RequestHeader().Get(protocol.VMHeader), c.RequestHeader(), msg)
	return err
}

// authorize authenticates the caller, decides the api policy, and returns
// ctx carrying the caller for the handler's own decisions.
func (a authzInterceptor) authorize(ctx context.Context, call *recorder.APICall, headerVM string, h map[string][]string, msg proto.Message) (context.Context, error) {
	if a.cfg.Policies == nil {
		return ctx, nil // no policy engine wired (unit tests of handlers)
	}
	caller, err := identity.Authenticate(ctx, h, a.cfg.Tokens)
	if err != nil {
		return ctx, connect.NewError(connect.CodeUnauthenticated, err)
	}
	// A request that names its VM is decided for that VM, the one its
	// handler acts on; a header naming another is refused. The header
	// names the VM of a relayed call alone: carreld's own procedures that
	// name no VM in their request act on none, whatever the header says
	// (a token or key may not list across VMs by naming its own).
	vm := ""
	if strings.HasPrefix(call.Procedure, "/"+agentServicePrefix) {
		vm = headerVM
	}
	if body := vmInMessage(call.Procedure, msg); body != "" {
		if headerVM != "" && headerVM != body {
			return ctx, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("the %s header names VM %q, the request VM %q", protocol.VMHeader, headerVM, body))
		}
		vm = body
	}
	// GetCaller is about the caller: a token's holder asks it of its own VM.
	if call.Procedure == apiv1connect.SystemServiceGetCallerProcedure && caller.Type == policy.CallerToken {
		vm = caller.VM
	}
	recorded := caller
	call.Caller, call.VM = &recorded, vm
	if a.cfg.Fence != nil && vm != "" && !unfenced[call.Procedure] {
		if err := a.cfg.Fence(call.Procedure, vm); err != nil {
			return ctx, connect.NewError(connect.CodeUnavailable, err)
		}
	}
	in := &policy.APIInput{Caller: caller, DaemonUID: a.cfg.DaemonUID, Procedure: call.Procedure, VM: vm, GPUs: a.cfg.gpusOf(call.Procedure, vm, msg)}
	if c, ok := msg.(*apiv1.CreateVMRequest); ok {
		in.Image, in.VMPolicy = c.Image, c.Policy
	}
	d, err := a.cfg.decision(ctx, in)
	call.Decision = d.ID
	if err != nil {
		return ctx, err
	}
	return identity.WithCaller(ctx, caller), nil
}

// vmInMessage finds the VM a request names in its body: VMService's
// requests name it in "name" (or "vm" for Exec), TokenService.CreateToken
// in "vm". Everything else names its VM in the Carrel-Vm header.
func vmInMessage(procedure string, msg proto.Message) string {
	if msg == nil {
		return ""
	}
	field := ""
	switch {
	case procedure == apiv1connect.VMServiceExecProcedure, procedure == apiv1connect.TokenServiceCreateTokenProcedure:
		field = "vm"
	case strings.HasPrefix(procedure, "/"+apiv1connect.VMServiceName+"/"):
		field = "name"
	default:
		return ""
	}
	r := msg.ProtoReflect()
	fd := r.Descriptor().Fields().ByName(protoreflect.Name(field))
	if fd == nil || fd.Kind() != protoreflect.StringKind {
		return ""
	}
	return r.Get(fd).String()
}

// policyFor names the policy that decides for vm: its bound policy, or
// the default for calls that name no VM (or a VM that does not exist,
// which the handler then reports).
func (cfg Config) policyFor(vm string) string {
	if vm != "" && cfg.Manager != nil {
		if name, err := cfg.Manager.PolicyOf(vm); err == nil {
			return name
		}
	}
	return policy.DefaultName
}

// decide evaluates in with the policy for its VM. A deny is
// PermissionDenied naming the rule; bad input is InvalidArgument; an
// evaluation failure denies too.
func (cfg Config) decide(ctx context.Context, in policy.Input) error {
	_, err := cfg.decision(ctx, in)
	return err
}

// decision is decide, returning the decision too.
func (cfg Config) decision(ctx context.Context, in policy.Input) (policy.Decision, error) {
	if cfg.Policies == nil {
		return policy.Decision{}, nil
	}
	vm := in.VMName()
	ctx = recorder.WithSession(ctx, vm, cfg.session(vm))
	d, err := cfg.Policies.Decide(ctx, cfg.policyFor(vm), in)
	switch {
	case errors.Is(err, policystore.ErrNotRecorded):
		return d, connect.NewError(connect.CodeUnavailable, err)
	case errors.Is(err, policy.ErrInvalidInput):
		return d, connect.NewError(connect.CodeInvalidArgument, err)
	case err != nil:
		return d, connect.NewError(connect.CodePermissionDenied, fmt.Errorf("denied: %w [decision %s]", err, d.ID))
	}
	if e := d.Err(); e != nil {
		return d, connect.NewError(connect.CodePermissionDenied, e)
	}
	return d, nil
}

// session names the current run of vm, for its records.
func (cfg Config) session(vm string) string {
	if cfg.Manager == nil || vm == "" {
		return ""
	}
	return cfg.Manager.SessionOf(vm)
}

// ended records a call once it has ended, in the session its VM is in
// then (a create's new one), with the limit of its key's that refused it,
// if one did: a refusal by quota is on record as one by policy is, by its
// api.call record, durable before the caller has its answer. (It is no
// policy.decision: no policy was evaluated, and those records are a
// policy revision's, which review and rerun read them as.)
func (a authzInterceptor) ended(ctx context.Context, call *recorder.APICall, err error) {
	code := "ok"
	if err != nil {
		code = connect.CodeOf(err).String()
	}
	call.Session = a.cfg.session(call.VM)
	var qe *quotaError
	if errors.As(err, &qe) {
		call.Quota = &qe.Quota
	}
	a.cfg.Recorder.APICallEnded(ctx, call, code, err)
}

// callerOf returns the caller the interceptor authenticated; handlers
// reached without one (unit tests) act for an anonymous peer.
func callerOf(ctx context.Context) policy.Caller {
	if c, ok := identity.CallerFrom(ctx); ok {
		return c
	}
	return policy.Caller{Type: policy.CallerPeer}
}
