package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/image/sbom"
	"github.com/carrel-os/carrel/image/store"
	"github.com/carrel-os/carrel/supervisor/api"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

// oneImage is an api.ImageLister holding one image, tagged "agent".
type oneImage struct {
	m       *manifest.Manifest
	raw     []byte
	digest  string
	created time.Time
}

var _ api.ImageLister = (*oneImage)(nil)

func (o *oneImage) List() ([]store.Entry, error) {
	return []store.Entry{{Digest: o.digest, Tags: []string{"agent"}, Manifest: o.m, Created: o.created, Size: 12}}, nil
}

func (o *oneImage) Resolve(ref string) (*store.Resolved, error) {
	if ref != "agent" && ref != o.digest {
		return nil, store.ErrNotFound
	}
	return &store.Resolved{Digest: o.digest, Manifest: o.m}, nil
}

func (o *oneImage) ManifestBytes(digest string) ([]byte, error) { return o.raw, nil }

func (o *oneImage) Import(dir, tag string) (store.Imported, error) {
	return store.Imported{}, errors.New("not supported")
}

func (o *oneImage) ImportNamed(dir string) (store.Imported, error) { return o.Import(dir, "") }

// sbomServer serves the image API over one stored image.
func sbomServer(t *testing.T) (string, *oneImage) {
	t.Helper()
	m := &manifest.Manifest{
		SchemaVersion: manifest.SchemaVersion,
		Name:          "agent",
		Arch:          "amd64",
		KernelVersion: "6.1.0-56-amd64",
		Kernel:        manifest.Part{Digest: manifest.DigestBytes([]byte("kernel")), Size: 6},
		Initrd:        manifest.Part{Digest: manifest.DigestBytes([]byte("initrd")), Size: 6},
		Cmdline:       "console=ttyS0",
		Packages: []manifest.Package{
			{Name: "bash", Version: "5.2.15-2+b7", Arch: "amd64"},
			{Name: "coreutils", Version: "9.1-1", Arch: "amd64"},
		},
	}
	raw, err := m.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	img := &oneImage{m: m, raw: raw, digest: manifest.DigestBytes(raw), created: time.Date(2025, 3, 14, 15, 9, 26, 0, time.UTC)}
	sock := filepath.Join(t.TempDir(), "api.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- api.Serve(ctx, l, api.Handler(api.Config{Images: img})) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return sock, img
}

func TestImageSBOM(t *testing.T) {
	sock, img := sbomServer(t)
	wantSPDX, err := sbom.SPDX(img.m, img.digest, img.created)
	if err != nil {
		t.Fatal(err)
	}
	wantCDX, err := sbom.CycloneDX(img.m, img.digest, img.created)
	if err != nil {
		t.Fatal(err)
	}
	if got := runCLI(t, "--socket", sock, "image", "sbom", "agent"); got != string(wantSPDX) {
		t.Errorf("image sbom agent:\n%s\nwant\n%s", got, wantSPDX)
	}
	if got := runCLI(t, "--socket", sock, "image", "sbom", img.digest, "--format", "cyclonedx"); got != string(wantCDX) {
		t.Errorf("image sbom --format cyclonedx:\n%s\nwant\n%s", got, wantCDX)
	}
	var doc struct {
		BOMFormat  string `json:"bomFormat"`
		Components []struct {
			PURL string `json:"purl"`
		} `json:"components"`
	}
	if err := json.Unmarshal(wantCDX, &doc); err != nil || doc.BOMFormat != "CycloneDX" || len(doc.Components) != 2 ||
		doc.Components[0].PURL != "pkg:deb/debian/bash@5.2.15-2%2Bb7?arch=amd64" {
		t.Errorf("CycloneDX %+v (%v)", doc, err)
	}

	out := filepath.Join(t.TempDir(), "sbom.json")
	if got := runCLI(t, "--socket", sock, "image", "sbom", "agent", "-o", out); got != "" {
		t.Errorf("with -o, stdout got %q", got)
	}
	if b, err := os.ReadFile(out); err != nil || !bytes.Equal(b, wantSPDX) {
		t.Errorf("%s: %v\n%s", out, err, b)
	}
	if ents, _ := os.ReadDir(filepath.Dir(out)); len(ents) != 1 {
		t.Errorf("temp file left beside %s: %v", out, ents)
	}
}

func TestImageSBOMErrors(t *testing.T) {
	sock, img := sbomServer(t)
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"agent", "--format", "xml"}, `--format must be spdx or cyclonedx, not "xml"`},
		{[]string{"nope"}, "not found"},
		{[]string{"agent", "-o", filepath.Join(t.TempDir(), "missing", "sbom.json")}, "no such file or directory"},
	} {
		root := newRootCmd()
		root.SetOut(&bytes.Buffer{})
		root.SetArgs(append([]string{"--socket", sock, "image", "sbom"}, c.args...))
		err := root.ExecuteContext(context.Background())
		if err == nil || !strings.Contains(describe(err), c.want) {
			t.Errorf("image sbom %v: %v, want an error with %q", c.args, err, c.want)
		}
	}

	// A manifest that does not hash to the digest is refused.
	img.raw = append(bytes.Clone(img.raw), ' ')
	root := newRootCmd()
	root.SetOut(&bytes.Buffer{})
	root.SetArgs([]string{"--socket", sock, "image", "sbom", "agent"})
	if err := root.ExecuteContext(context.Background()); err == nil || !strings.Contains(err.Error(), "whose digest is") {
		t.Errorf("mismatched manifest: %v", err)
	}
}

func TestRenderSBOMCreatedAt(t *testing.T) {
	_, img := sbomServer(t)
	for _, created := range []string{"", "yesterday", "2025-03-14 15:09:26"} {
		_, err := renderSBOM(sbom.SPDX, &apiv1.Image{Digest: img.digest, CreatedAt: created}, img.raw)
		if err == nil || !strings.Contains(err.Error(), "creation time") {
			t.Errorf("CreatedAt %q: %v, want a creation time error", created, err)
		}
	}
	if _, err := renderSBOM(sbom.SPDX, &apiv1.Image{Digest: img.digest, CreatedAt: "2025-03-14T16:09:26+01:00"}, img.raw); err != nil {
		t.Errorf("RFC 3339 with an offset: %v", err)
	}
}
