package node

import (
	"context"
	"slices"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/supervisor/client"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
	"github.com/carrel-os/carrel/supervisor/gen/apiv1/apiv1connect"
)

// vmService answers CreateVM and ListVMs; any other call panics.
type vmService struct {
	apiv1connect.VMServiceClient
	created *apiv1.CreateVMRequest
	vms     []*apiv1.VM
}

func (s *vmService) CreateVM(_ context.Context, req *connect.Request[apiv1.CreateVMRequest]) (*connect.Response[apiv1.CreateVMResponse], error) {
	s.created = req.Msg
	return connect.NewResponse(&apiv1.CreateVMResponse{}), nil
}

func (s *vmService) ListVMs(context.Context, *connect.Request[apiv1.ListVMsRequest]) (*connect.Response[apiv1.ListVMsResponse], error) {
	return connect.NewResponse(&apiv1.ListVMsResponse{Vms: s.vms}), nil
}

func TestAPIVMsCreate(t *testing.T) {
	gpus := []string{"0000:01:00.0"}
	spec := Spec{Image: "base", CPUs: 2, Deadline: 1500 * time.Millisecond}
	for _, without := range []bool{false, true} {
		s := &vmService{}
		c := APIVMs{Client: &client.Client{VMs: s}, WithoutGPUs: without}
		if err := c.Create(context.Background(), "web", spec, gpus, map[string]string{LabelRun: "uid"}); err != nil {
			t.Fatal(err)
		}
		req := s.created
		if req.Name != "web" || req.Image != "base" || req.Cpus != 2 || req.Labels[LabelRun] != "uid" {
			t.Errorf("request %v: not the run's VM", req)
		}
		if req.TtlSeconds != 2 || req.ExpiryAction != apiv1.ExpiryAction_EXPIRY_ACTION_STOP {
			t.Errorf("a deadline of 1.5 s: TTL %d s, on expiry %v; want 2 s, stop", req.TtlSeconds, req.ExpiryAction)
		}
		want := gpus
		if without {
			want = nil
		}
		if !slices.Equal(req.Gpus, want) {
			t.Errorf("WithoutGPUs %v: GPUs %v, want %v", without, req.Gpus, want)
		}
	}
}

func TestAPIVMsList(t *testing.T) {
	s := &vmService{vms: []*apiv1.VM{
		{Name: "booting", State: apiv1.VMState_VM_STATE_RUNNING, AgentState: apiv1.AgentState_AGENT_STATE_UNKNOWN},
		{Name: "ready", State: apiv1.VMState_VM_STATE_RUNNING, AgentState: apiv1.AgentState_AGENT_STATE_READY, Session: "s1"},
		{Name: "stopped", State: apiv1.VMState_VM_STATE_STOPPED, AgentState: apiv1.AgentState_AGENT_STATE_READY, LastError: "boom"},
		{Name: "stopping", State: apiv1.VMState_VM_STATE_STOPPING},
	}}
	got, err := APIVMs{Client: &client.Client{VMs: s}}.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	want := []VM{
		{Name: "booting", Running: true},
		{Name: "ready", Session: "s1", Running: true, Ready: true},
		{Name: "stopped", Stopped: true, LastError: "boom"},
		{Name: "stopping"},
	}
	if !slices.EqualFunc(got, want, func(a, b VM) bool {
		return a.Name == b.Name && a.Session == b.Session && a.LastError == b.LastError &&
			a.Running == b.Running && a.Ready == b.Ready && a.Stopped == b.Stopped
	}) {
		t.Errorf("List = %+v, want %+v", got, want)
	}
}
