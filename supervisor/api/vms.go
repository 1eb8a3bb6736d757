package api

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/supervisor/agentlink"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
	"github.com/carrel-os/carrel/supervisor/gen/apiv1/apiv1connect"
	"github.com/carrel-os/carrel/supervisor/identity"
	"github.com/carrel-os/carrel/supervisor/registry"
	"github.com/carrel-os/carrel/supervisor/relay"
	"github.com/carrel-os/carrel/supervisor/vm"
)

// Exec limits.
const (
	defaultExecTimeout = 10 * time.Minute
	maxExecTimeout     = 24 * time.Hour
)

type vmService struct {
	cfg    Config
	relay  *relay.Relay
	quotas quotas
}

var _ apiv1connect.VMServiceHandler = (*vmService)(nil)

func (s *vmService) CreateVM(ctx context.Context, req *connect.Request[apiv1.CreateVMRequest]) (*connect.Response[apiv1.CreateVMResponse], error) {
	m := req.Msg
	p := vm.CreateParams{Name: m.Name, Image: m.Image, MemoryBytes: m.MemoryBytes, CPUs: m.Cpus, Policy: m.Policy,
		WorkspaceBytes: m.WorkspaceBytes, MaxProcesses: m.MaxProcesses, GPUs: m.Gpus,
		Ephemeral: m.Ephemeral, DiskBytes: m.DiskBytes,
		Env: m.Env, Labels: m.Labels, TTL: time.Duration(min(m.TtlSeconds, maxTTLSeconds)) * time.Second, ExpiryAction: expiryAction(m.ExpiryAction)}
	release, err := s.reserveVM(ctx, p.Name, p.Footprint())
	if err != nil {
		return nil, err
	}
	defer release()
	rec, err := s.cfg.Manager.Create(ctx, p)
	if err != nil {
		return nil, toConnect(err)
	}
	st, err := s.cfg.Manager.Get(rec.Name)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&apiv1.CreateVMResponse{Vm: toProto(st)}), nil
}

func (s *vmService) GetVM(ctx context.Context, req *connect.Request[apiv1.GetVMRequest]) (*connect.Response[apiv1.GetVMResponse], error) {
	st, err := s.cfg.Manager.Get(req.Msg.Name)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&apiv1.GetVMResponse{Vm: toProto(st)}), nil
}

// ListVMs lists the VMs that carry every label asked for. A caller with
// an API key sees only the VMs in its key's namespace.
func (s *vmService) ListVMs(ctx context.Context, req *connect.Request[apiv1.ListVMsRequest]) (*connect.Response[apiv1.ListVMsResponse], error) {
	resp := &apiv1.ListVMsResponse{}
	caller, _ := identity.CallerFrom(ctx)
	for _, st := range s.cfg.Manager.List() {
		if !hasLabels(st.Labels, req.Msg.Labels) || !identity.Sees(caller, st.Name) {
			continue
		}
		resp.Vms = append(resp.Vms, toProto(st))
	}
	return connect.NewResponse(resp), nil
}

func hasLabels(have, want map[string]string) bool {
	for k, v := range want {
		if got, ok := have[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// maxTTLSeconds keeps a time to live from overflowing a time.Duration;
// the manager refuses anything over vm.MaxTTL.
const maxTTLSeconds = uint64(10 * vm.MaxTTL / time.Second)

func expiryAction(a apiv1.ExpiryAction) string {
	switch a {
	case apiv1.ExpiryAction_EXPIRY_ACTION_UNSPECIFIED:
		return ""
	case apiv1.ExpiryAction_EXPIRY_ACTION_DELETE:
		return registry.ExpireDelete
	case apiv1.ExpiryAction_EXPIRY_ACTION_STOP:
		return registry.ExpireStop
	}
	return a.String() // refused by the manager, by name
}

func (s *vmService) SetVMExpiry(ctx context.Context, req *connect.Request[apiv1.SetVMExpiryRequest]) (*connect.Response[apiv1.SetVMExpiryResponse], error) {
	ttl := time.Duration(min(req.Msg.TtlSeconds, maxTTLSeconds)) * time.Second
	if _, err := s.cfg.Manager.SetExpiry(ctx, req.Msg.Name, ttl); err != nil {
		return nil, toConnect(err)
	}
	st, err := s.cfg.Manager.Get(req.Msg.Name)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&apiv1.SetVMExpiryResponse{Vm: toProto(st)}), nil
}

func (s *vmService) StartVM(ctx context.Context, req *connect.Request[apiv1.StartVMRequest]) (*connect.Response[apiv1.StartVMResponse], error) {
	if _, err := s.cfg.Manager.Start(ctx, req.Msg.Name); err != nil {
		return nil, toConnect(err)
	}
	st, err := s.cfg.Manager.Get(req.Msg.Name)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&apiv1.StartVMResponse{Vm: toProto(st)}), nil
}

func (s *vmService) ResetVM(ctx context.Context, req *connect.Request[apiv1.ResetVMRequest]) (*connect.Response[apiv1.ResetVMResponse], error) {
	if _, err := s.cfg.Manager.Reset(ctx, req.Msg.Name, req.Msg.Workspace); err != nil {
		return nil, toConnect(err)
	}
	st, err := s.cfg.Manager.Get(req.Msg.Name)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&apiv1.ResetVMResponse{Vm: toProto(st)}), nil
}

func (s *vmService) PauseVM(ctx context.Context, req *connect.Request[apiv1.PauseVMRequest]) (*connect.Response[apiv1.PauseVMResponse], error) {
	if _, err := s.cfg.Manager.Pause(ctx, req.Msg.Name); err != nil {
		return nil, toConnect(err)
	}
	st, err := s.cfg.Manager.Get(req.Msg.Name)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&apiv1.PauseVMResponse{Vm: toProto(st)}), nil
}

func (s *vmService) ResumeVM(ctx context.Context, req *connect.Request[apiv1.ResumeVMRequest]) (*connect.Response[apiv1.ResumeVMResponse], error) {
	if _, err := s.cfg.Manager.Resume(ctx, req.Msg.Name); err != nil {
		return nil, toConnect(err)
	}
	st, err := s.cfg.Manager.Get(req.Msg.Name)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&apiv1.ResumeVMResponse{Vm: toProto(st)}), nil
}

func (s *vmService) StopVM(ctx context.Context, req *connect.Request[apiv1.StopVMRequest]) (*connect.Response[apiv1.StopVMResponse], error) {
	if _, err := s.cfg.Manager.Stop(ctx, req.Msg.Name, req.Msg.Force); err != nil {
		return nil, toConnect(err)
	}
	st, err := s.cfg.Manager.Get(req.Msg.Name)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&apiv1.StopVMResponse{Vm: toProto(st)}), nil
}

func (s *vmService) DeleteVM(ctx context.Context, req *connect.Request[apiv1.DeleteVMRequest]) (*connect.Response[apiv1.DeleteVMResponse], error) {
	if err := s.cfg.Manager.Delete(ctx, req.Msg.Name, req.Msg.Force); err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&apiv1.DeleteVMResponse{}), nil
}

// Exec runs a command through the same relay as AgentService.Exec and
// Process, bounded by its timeout; the guest's events, checked there, are
// passed on as VMService's.
func (s *vmService) Exec(ctx context.Context, req *connect.Request[apiv1.ExecRequest], out *connect.ServerStream[apiv1.ExecResponse]) error {
	m := req.Msg
	if len(m.Argv) == 0 {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("exec: a command is required"))
	}
	timeout := defaultExecTimeout
	if m.TimeoutSeconds > 0 {
		timeout = time.Duration(m.TimeoutSeconds) * time.Second
	}
	if timeout > maxExecTimeout {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("exec: timeout is over %s", maxExecTimeout))
	}
	return s.relay.Exec(ctx, m.Vm, &agentv1.ExecRequest{Argv: m.Argv, Env: m.Env, Cwd: m.Cwd}, timeout, func(ev *agentv1.ExecResponse) error {
		return out.Send(execEvent(ev))
	})
}

// execEvent is a guest's exec event, already checked by the relay, as
// VMService.Exec sends it.
func execEvent(ev *agentv1.ExecResponse) *apiv1.ExecResponse {
	switch e := ev.Event.(type) {
	case *agentv1.ExecResponse_Started:
		return &apiv1.ExecResponse{Event: &apiv1.ExecResponse_Pid{Pid: e.Started.GetPid()}}
	case *agentv1.ExecResponse_Stdout:
		return &apiv1.ExecResponse{Event: &apiv1.ExecResponse_Stdout{Stdout: e.Stdout}}
	case *agentv1.ExecResponse_Stderr:
		return &apiv1.ExecResponse{Event: &apiv1.ExecResponse_Stderr{Stderr: e.Stderr}}
	case *agentv1.ExecResponse_Exit:
		return &apiv1.ExecResponse{Event: &apiv1.ExecResponse_Exit{Exit: &apiv1.ExitStatus{Code: e.Exit.GetCode(), Signal: e.Exit.GetSignal()}}}
	}
	return &apiv1.ExecResponse{}
}

func toProto(st vm.Status) *apiv1.VM {
	v := &apiv1.VM{
		Name:        st.Name,
		Id:          st.ID,
		ImageDigest: st.ImageDigest,
		MemoryBytes: st.MemoryBytes,
		Cpus:        st.CPUs,
		Driver:      st.Driver,
		Transport:   st.Transport,
		DataPort:    st.DataPort,
		CreatedAt:   st.CreatedAt.Format(time.RFC3339),
		LastError:   st.LastError,
		Policy:      st.PolicyName(),
		Session:     st.Session,
		Paused:      st.Paused || st.Held,
		Held:        st.Held,

		WorkspaceBytes: st.WorkspaceBytes,
		MaxProcesses:   st.MaxProcesses,
		Gpus:           st.GPUs,
		Ephemeral:      st.Ephemeral,
		DiskBytes:      st.DiskBytes,
		RootHash:       st.RootHash,
	}
	if st.Paused {
		v.PausedAt = st.PausedAt.Format(time.RFC3339)
	}
	v.Labels = st.Labels
	for _, kv := range st.Env {
		k, _, _ := strings.Cut(kv, "=")
		v.EnvNames = append(v.EnvNames, k)
	}
	if !st.ExpiresAt.IsZero() {
		v.ExpiresAt = st.ExpiresAt.Format(time.RFC3339)
		v.ExpiryAction = apiv1.ExpiryAction_EXPIRY_ACTION_DELETE
		if st.ExpiryAction == registry.ExpireStop {
			v.ExpiryAction = apiv1.ExpiryAction_EXPIRY_ACTION_STOP
		}
	}
	if o := st.Origin; o != nil {
		v.Origin = &apiv1.Origin{Vm: o.VM, Snapshot: o.Snapshot, Session: o.Session, Fork: o.Fork}
	}
	switch st.State {
	case registry.StateCreating:
		v.State = apiv1.VMState_VM_STATE_CREATING
	case registry.StateStarting:
		v.State = apiv1.VMState_VM_STATE_STARTING
	case registry.StateRunning:
		v.State = apiv1.VMState_VM_STATE_RUNNING
	case registry.StateStopping:
		v.State = apiv1.VMState_VM_STATE_STOPPING
	case registry.StateStopped:
		v.State = apiv1.VMState_VM_STATE_STOPPED
	}
	switch st.Agent {
	case agentlink.Ready:
		v.AgentState = apiv1.AgentState_AGENT_STATE_READY
	case agentlink.Unhealthy:
		v.AgentState = apiv1.AgentState_AGENT_STATE_UNHEALTHY
	default:
		v.AgentState = apiv1.AgentState_AGENT_STATE_UNKNOWN
	}
	if st.Instance != nil {
		v.Pid = int32(st.Instance.PID)
		v.Accelerator = st.Instance.Accelerator
	}
	return v
}
