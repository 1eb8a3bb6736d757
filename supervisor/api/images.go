package api

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"syscall"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/image/debian"
	"github.com/carrel-os/carrel/image/imagedir"
	"github.com/carrel-os/carrel/image/store"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

// ImageLister lists, resolves and imports stored images.
type ImageLister interface {
	List() ([]store.Entry, error)
	Resolve(ref string) (*store.Resolved, error)
	ManifestBytes(digest string) ([]byte, error)
	Import(dir, tag string) (store.Imported, error)
	ImportNamed(dir string) (store.Imported, error)
}

type imageService struct {
	cfg Config
}

func (s *imageService) BuildImage(ctx context.Context, req *connect.Request[apiv1.BuildImageRequest]) (*connect.Response[apiv1.BuildImageResponse], error) {
	m := req.Msg
	n := 0
	for _, set := range []bool{m.Dev, m.SpecName != "", m.SpecJson != ""} {
		if set {
			n++
		}
	}
	if n != 1 {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("build one of: dev=true (carrel image build --dev), spec_name (a built-in spec such as agent), or spec_json"))
	}
	if s.cfg.Build == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("this carreld has no image builder configured"))
	}
	var spec *debian.Spec
	var err error
	switch {
	case m.SpecName != "":
		spec, err = debian.Builtin(m.SpecName)
	case m.SpecJson != "":
		spec, err = debian.ParseSpec([]byte(m.SpecJson))
	}
	if err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	tag := m.Tag
	switch {
	case tag != "":
	case spec != nil:
		tag = spec.Name
	default:
		tag = "dev"
	}
	if !store.ValidTagName(tag) {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("invalid tag name"))
	}
	digest, cached, err := s.cfg.Build(ctx, spec, tag, m.NoCache)
	if err != nil {
		return nil, imageError(err)
	}
	img, err := s.find(digest)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&apiv1.BuildImageResponse{Image: img, Cached: cached}), nil
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

func (s *imageService) InspectImage(ctx context.Context, req *connect.Request[apiv1.InspectImageRequest]) (*connect.Response[apiv1.InspectImageResponse], error) {
	r, err := s.cfg.Images.Resolve(req.Msg.Ref)
	if err != nil {
		return nil, imageError(err)
	}
	b, err := s.cfg.Images.ManifestBytes(r.Digest)
	if err != nil {
		return nil, imageError(err)
	}
	img, err := s.find(r.Digest)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&apiv1.InspectImageResponse{Image: img, ManifestJson: string(b)}), nil
}

func (s *imageService) ImportImage(ctx context.Context, req *connect.Request[apiv1.ImportImageRequest]) (*connect.Response[apiv1.ImportImageResponse], error) {
	if !filepath.IsAbs(req.Msg.Path) {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("import: path %q: want an absolute path on carreld's host", req.Msg.Path))
	}
	tag := req.Msg.Tag
	if tag != "" && !store.ValidTagName(tag) {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("invalid tag name %q", tag))
	}
	var out store.Imported
	var err error
	if tag == "" {
		out, err = s.cfg.Images.ImportNamed(req.Msg.Path)
	} else {
		out, err = s.cfg.Images.Import(req.Msg.Path, tag)
	}
	if err != nil {
		return nil, imageError(err)
	}
	img, err := s.find(out.Digest)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&apiv1.ImportImageResponse{Image: img, Already: out.Already}), nil
}

// imageError maps store and image-directory errors to connect codes.
func imageError(err error) error {
	switch {
	case errors.Is(err, store.ErrNotFound):
		return connect.NewError(connect.CodeNotFound, err)
	case errors.Is(err, store.ErrInvalidRef), errors.Is(err, imagedir.ErrInvalid):
		return connect.NewError(connect.CodeInvalidArgument, err)
	case errors.Is(err, syscall.ENOSPC):
		return connect.NewError(connect.CodeResourceExhausted, err)
	}
	return connect.NewError(connect.CodeInternal, err)
}

func imageProto(e store.Entry) *apiv1.Image {
	img := &apiv1.Image{Digest: e.Digest, Tags: e.Tags, Size: uint64(e.Size), CreatedAt: e.Created.UTC().Format(time.RFC3339), Error: e.Error}
	if m := e.Manifest; m != nil {
		img.KernelVersion = m.KernelVersion
		img.Name = m.Name
		img.Packages = uint32(len(m.Packages))
		if m.Verity != nil {
			img.RootHash = m.Verity.RootHash
		}
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

func (s *systemService) GetCaller(ctx context.Context, req *connect.Request[apiv1.GetCallerRequest]) (*connect.Response[apiv1.GetCallerResponse], error) {
	c := callerOf(ctx)
	return connect.NewResponse(&apiv1.GetCallerResponse{Type: string(c.Type), Uid: c.UID, Gid: c.GID, TokenId: c.TokenID, Vm: c.VM}), nil
}
