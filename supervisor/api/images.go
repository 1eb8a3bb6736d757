package api

import (
	"context"
	"errors"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/image/store"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

// ImageLister lists stored images.
type ImageLister interface {
	List() ([]store.Entry, error)
	Resolve(ref string) (*store.Resolved, error)
}

type imageService struct {
	cfg Config
}

func (s *imageService) BuildImage(ctx context.Context, req *connect.Request[apiv1.BuildImageRequest]) (*connect.Response[apiv1.BuildImageResponse], error) {
	if !req.Msg.Dev {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("only the development image can be built here: pass dev=true (carrel image build --dev)"))
	}
	if s.cfg.Build == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("this carreld has no image builder configured"))
	}
	tag := req.Msg.Tag
	if tag == "" {
		tag = "dev"
	}
	if !store.ValidTagName(tag) {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("invalid tag name"))
	}
	digest, err := s.cfg.Build(ctx, tag)
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	img, err := s.find(digest)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&apiv1.BuildImageResponse{Image: img}), nil
}

func (s *imageService) find(digest string) (*apiv1.Image, error) {
	entries, err := s.cfg.Images.List()
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	for _, e := range entries {
		if e.Digest == digest {
			return imageProto(e), nil
		}
	}
	return nil, connect.NewError(connect.CodeNotFound, errors.New("image "+digest+" not found after build"))
}

func (s *imageService) ListImages(ctx context.Context, req *connect.Request[apiv1.ListImagesRequest]) (*connect.Response[apiv1.ListImagesResponse], error) {
	entries, err := s.cfg.Images.List()
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	resp := &apiv1.ListImagesResponse{}
	for _, e := range entries {
		resp.Images = append(resp.Images, imageProto(e))
	}
	return connect.NewResponse(resp), nil
}

func imageProto(e store.Entry) *apiv1.Image {
	img := &apiv1.Image{Digest: e.Digest, Tags: e.Tags, Size: uint64(e.Size), CreatedAt: e.Created.UTC().Format(time.RFC3339)}
	if e.Manifest != nil {
		img.KernelVersion = e.Manifest.KernelVersion
	}
	return img
}

type systemService struct {
	cfg Config
}

func (s *systemService) GetInfo(ctx context.Context, req *connect.Request[apiv1.GetInfoRequest]) (*connect.Response[apiv1.GetInfoResponse], error) {
	var info Info
	if s.cfg.Info != nil {
		info = s.cfg.Info()
	}
	return connect.NewResponse(&apiv1.GetInfoResponse{
		Version:     info.Version,
		Accelerator: info.Accelerator,
		StateDir:    info.StateDir,
		Vms:         uint32(len(s.cfg.Manager.List())),
		Vsock:       info.Vsock,
	}), nil
}
