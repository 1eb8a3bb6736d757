package api

import (
	"context"
	"time"

	"connectrpc.com/connect"

	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
	"github.com/carrel-os/carrel/supervisor/vm"
)

func (s *vmService) SnapshotVM(ctx context.Context, req *connect.Request[apiv1.SnapshotVMRequest]) (*connect.Response[apiv1.SnapshotVMResponse], error) {
	release, err := s.reserveSnapshot(ctx, req.Msg.Name, req.Msg.Snapshot)
	if err != nil {
		return nil, err
	}
	defer release()
	snap, err := s.cfg.Manager.Snapshot(ctx, req.Msg.Name, vm.SnapshotParams{Name: req.Msg.Snapshot, Note: req.Msg.Note})
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&apiv1.SnapshotVMResponse{Snapshot: snapshotProto(snap)}), nil
}

func (s *vmService) ListSnapshots(ctx context.Context, req *connect.Request[apiv1.ListSnapshotsRequest]) (*connect.Response[apiv1.ListSnapshotsResponse], error) {
	snaps, err := s.cfg.Manager.Snapshots(req.Msg.Name)
	if err != nil {
		return nil, toConnect(err)
	}
	resp := &apiv1.ListSnapshotsResponse{}
	for _, sn := range snaps {
		resp.Snapshots = append(resp.Snapshots, snapshotProto(sn))
	}
	return connect.NewResponse(resp), nil
}

func (s *vmService) RestoreVM(ctx context.Context, req *connect.Request[apiv1.RestoreVMRequest]) (*connect.Response[apiv1.RestoreVMResponse], error) {
	if _, err := s.cfg.Manager.Restore(ctx, req.Msg.Name, req.Msg.Snapshot); err != nil {
		return nil, toConnect(err)
	}
	st, err := s.cfg.Manager.Get(req.Msg.Name)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&apiv1.RestoreVMResponse{Vm: toProto(st)}), nil
}

func (s *vmService) DeleteSnapshot(ctx context.Context, req *connect.Request[apiv1.DeleteSnapshotRequest]) (*connect.Response[apiv1.DeleteSnapshotResponse], error) {
	if err := s.cfg.Manager.DeleteSnapshot(ctx, req.Msg.Name, req.Msg.Snapshot); err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&apiv1.DeleteSnapshotResponse{}), nil
}

func (s *vmService) ForkVM(ctx context.Context, req *connect.Request[apiv1.ForkVMRequest]) (*connect.Response[apiv1.ForkVMResponse], error) {
	// A fork is a new VM of its source's sizes (a key's policy refuses
	// forks, unless its operator gave keys the admin class).
	src, err := s.cfg.Manager.Get(req.Msg.Name)
	if err != nil {
		return nil, toConnect(err)
	}
	release, err := s.reserveVM(ctx, req.Msg.NewName, vm.FootprintOf(src.Record))
	if err != nil {
		return nil, err
	}
	defer release()
	rec, err := s.cfg.Manager.Fork(ctx, req.Msg.Name, req.Msg.NewName, req.Msg.Snapshot)
	if err != nil {
		return nil, toConnect(err)
	}
	st, err := s.cfg.Manager.Get(rec.Name)
	if err != nil {
		return nil, toConnect(err)
	}
	return connect.NewResponse(&apiv1.ForkVMResponse{Vm: toProto(st)}), nil
}

func snapshotProto(s vm.Snapshot) *apiv1.Snapshot {
	return &apiv1.Snapshot{
		Name: s.Name, Vm: s.VM, CreatedAt: s.CreatedAt.Format(time.RFC3339Nano), Session: s.Session,
		ImageDigest: s.ImageDigest, MemoryBytes: s.MemoryBytes, StateBytes: s.State.Bytes, StateSha256: s.State.SHA256,
		Bytes: s.Bytes(), Guest: s.Guest, Note: s.Note,
	}
}
