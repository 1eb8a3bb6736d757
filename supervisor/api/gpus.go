package api

import (
	"context"
	"errors"
	"fmt"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
	"github.com/carrel-os/carrel/supervisor/gen/apiv1/apiv1connect"
	"github.com/carrel-os/carrel/supervisor/gpu"
)

type gpuService struct {
	cfg Config
}

var _ apiv1connect.GPUServiceHandler = (*gpuService)(nil)

// ListGPUs lists the host's display controllers, each with the VM that
// holds it (or a GPU of its slot).
func (s *gpuService) ListGPUs(ctx context.Context, req *connect.Request[apiv1.ListGPUsRequest]) (*connect.Response[apiv1.ListGPUsResponse], error) {
	if s.cfg.GPUs == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("this carreld does not pass GPUs through"))
	}
	inv, err := s.cfg.GPUs.List()
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("list gpus: %w", err))
	}
	holder := map[gpu.Address]string{}
	if s.cfg.Manager != nil {
		for _, st := range s.cfg.Manager.List() {
			for _, g := range st.GPUs {
				if a, err := gpu.ParseAddress(g); err == nil {
					holder[a] = st.Name
				}
			}
		}
	}
	resp := &apiv1.ListGPUsResponse{Iommu: inv.IOMMU}
	for _, g := range inv.GPUs {
		pg := &apiv1.GPU{
			Address: g.Address.String(), Ids: g.IDs(), Name: g.Name, Class: fmt.Sprintf("0x%06x", g.Class),
			Driver: g.Driver, IommuGroup: int32(g.IOMMUGroup), NumaNode: int32(g.NUMANode), BootVga: g.BootVGA,
			Assignable: g.Assignable, Reason: g.Reason, Vm: holder[g.Address],
		}
		for _, m := range g.Group {
			if pg.Vm == "" && m.Role == gpu.RolePassed {
				pg.Vm = holder[m.Address]
			}
			pg.Group = append(pg.Group, &apiv1.PCIDevice{
				Address: m.Address.String(), Ids: m.IDs(), Class: fmt.Sprintf("0x%06x", m.Class), Driver: m.Driver, Role: string(m.Role),
			})
		}
		resp.Gpus = append(resp.Gpus, pg)
	}
	return connect.NewResponse(resp), nil
}

// gpusOf returns the GPUs a call would give its VM, for the api policy to
// decide: CreateVM's, or the recorded ones of the VM StartVM boots (so
// that a policy that no longer allows them stops the VM getting them
// again).
func (cfg Config) gpusOf(procedure, vm string, msg proto.Message) []string {
	switch procedure {
	case apiv1connect.VMServiceCreateVMProcedure:
		if m, ok := msg.(*apiv1.CreateVMRequest); ok {
			return m.Gpus
		}
	case apiv1connect.VMServiceStartVMProcedure:
		if cfg.Manager != nil {
			if st, err := cfg.Manager.Get(vm); err == nil {
				return st.GPUs
			}
		}
	}
	return nil
}
