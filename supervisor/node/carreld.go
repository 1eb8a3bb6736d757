package node

import (
	"context"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/supervisor/client"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

// APIVMs is VMs over carreld's own API client.
type APIVMs struct {
	Client *client.Client
	// WithoutGPUs boots runs' VMs without the GPUs allocated to them
	// (fleet tests on hosts with a fake sysfs): they are still reported.
	WithoutGPUs bool
}

var _ VMs = APIVMs{}

// Create creates and boots a VM, returning once its agent answers.
func (c APIVMs) Create(ctx context.Context, name string, spec Spec, gpus []string, labels map[string]string) error {
	req := &apiv1.CreateVMRequest{Name: name, Image: spec.Image, Cpus: spec.CPUs, MemoryBytes: spec.MemoryBytes,
		WorkspaceBytes: spec.WorkspaceBytes, Policy: spec.Policy, Labels: labels}
	if !c.WithoutGPUs {
		req.Gpus = gpus
	}
	if spec.Deadline > 0 {
		req.TtlSeconds = uint64((spec.Deadline + 999_999_999) / 1_000_000_000)
		req.ExpiryAction = apiv1.ExpiryAction_EXPIRY_ACTION_STOP
	}
	_, err := c.Client.VMs.CreateVM(ctx, connect.NewRequest(req))
	return err
}

// List lists carreld's VMs.
func (c APIVMs) List(ctx context.Context) ([]VM, error) {
	resp, err := c.Client.VMs.ListVMs(ctx, connect.NewRequest(&apiv1.ListVMsRequest{}))
	if err != nil {
		return nil, err
	}
	out := make([]VM, 0, len(resp.Msg.Vms))
	for _, v := range resp.Msg.Vms {
		out = append(out, VM{
			Name: v.Name, Labels: v.Labels, Session: v.Session, LastError: v.LastError,
			Running: v.State == apiv1.VMState_VM_STATE_RUNNING,
			Ready:   v.State == apiv1.VMState_VM_STATE_RUNNING && v.AgentState == apiv1.AgentState_AGENT_STATE_READY,
			Stopped: v.State == apiv1.VMState_VM_STATE_STOPPED,
		})
	}
	return out, nil
}

// Stop stops a VM.
func (c APIVMs) Stop(ctx context.Context, name string, force bool) error {
	_, err := c.Client.VMs.StopVM(ctx, connect.NewRequest(&apiv1.StopVMRequest{Name: name, Force: force}))
	return err
}

// Delete deletes a stopped VM.
func (c APIVMs) Delete(ctx context.Context, name string) error {
	_, err := c.Client.VMs.DeleteVM(ctx, connect.NewRequest(&apiv1.DeleteVMRequest{Name: name, Force: true}))
	return err
}
