package main

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"os"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// imageUser is the unprivileged user the controller runs as (nonroot
// in distroless images); the Deployment asks for it too.
const imageUser = "65532:65532"

// writeImage writes an OCI image layout to dir holding this binary as
// /carrel-controller, its entrypoint: the image carrel fleet manifests'
// Deployment names, made by the binary of the same version. One layer,
// no shell, no base image; the times are fixed, so two builds of one
// binary give one digest.
func writeImage(dir, tag string) (v1.Hash, error) {
	exe, err := os.Executable()
	if err != nil {
		return v1.Hash{}, err
	}
	bin, err := os.ReadFile(exe)
	if err != nil {
		return v1.Hash{}, err
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	epoch := time.Unix(0, 0)
	if err := tw.WriteHeader(&tar.Header{Name: "carrel-controller", Mode: 0o755, Size: int64(len(bin)), ModTime: epoch, Typeflag: tar.TypeReg, Format: tar.FormatPAX}); err != nil {
		return v1.Hash{}, err
	}
	if _, err := tw.Write(bin); err != nil {
		return v1.Hash{}, err
	}
	if err := tw.Close(); err != nil {
		return v1.Hash{}, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(buf.Bytes())), nil },
		tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return v1.Hash{}, err
	}
	img, err := mutate.AppendLayers(mutate.MediaType(empty.Image, types.OCIManifestSchema1), layer)
	if err != nil {
		return v1.Hash{}, err
	}
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	img, err = mutate.Config(img, v1.Config{Entrypoint: []string{"/carrel-controller"}, User: imageUser,
		Labels: map[string]string{"org.opencontainers.image.title": "carrel-controller", "org.opencontainers.image.version": version}})
	if err != nil {
		return v1.Hash{}, err
	}
	img, err = mutate.CreatedAt(img, v1.Time{Time: epoch})
	if err != nil {
		return v1.Hash{}, err
	}
	if _, err := os.Stat(dir); err == nil {
		return v1.Hash{}, fmt.Errorf("%s exists: give a new directory", dir)
	}
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return v1.Hash{}, err
	}
	if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{"org.opencontainers.image.ref.name": tag})); err != nil {
		return v1.Hash{}, err
	}
	return img.Digest()
}
