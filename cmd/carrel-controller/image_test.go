package main

import (
	"archive/tar"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/layout"
)

// TestWriteImage: the layout holds one image, of one layer with the
// running binary (here the test's) as /carrel-controller, run as a user
// that is not root; writing it twice gives one digest.
func TestWriteImage(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "img")
	d1, err := writeImage(dir, "carrel-controller:test")
	if err != nil {
		t.Fatal(err)
	}
	d2, err := writeImage(filepath.Join(t.TempDir(), "again"), "carrel-controller:test")
	if err != nil || d1 != d2 {
		t.Fatalf("second write: %v, %v; want digest %v", d2, err, d1)
	}
	if _, err := writeImage(dir, "x"); err == nil {
		t.Error("wrote over an existing directory")
	}
	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	img, err := idx.Image(d1)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.Config.Entrypoint) != 1 || cfg.Config.Entrypoint[0] != "/carrel-controller" || cfg.Config.User != imageUser {
		t.Errorf("config %+v", cfg.Config)
	}
	layers, err := img.Layers()
	if err != nil || len(layers) != 1 {
		t.Fatalf("%d layers, %v", len(layers), err)
	}
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	exe, _ := os.Executable()
	st, _ := os.Stat(exe)
	tr := tar.NewReader(rc)
	h, err := tr.Next()
	if err != nil || h.Name != "carrel-controller" || h.Mode != 0o755 || h.Size != st.Size() {
		t.Fatalf("first entry %+v, %v; want carrel-controller, 0755, %d bytes", h, err, st.Size())
	}
	if _, err := io.Copy(io.Discard, tr); err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Next(); !errors.Is(err, io.EOF) {
		t.Errorf("more than one entry: %v", err)
	}
}
