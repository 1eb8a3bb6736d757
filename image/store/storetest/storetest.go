// Package storetest makes image stores for tests of code that boots
// images without booting them for real.
package storetest

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/image/store"
)

// WithFakeImage opens a store in dir and tags a small fake image (kernel and
// initrd are a few bytes of text) as tag. It returns the store and the
// image's digest.
func WithFakeImage(t testing.TB, dir, tag string) (*store.Store, string) {
	t.Helper()
	st, err := store.Open(filepath.Join(dir, "images"))
	if err != nil {
		t.Fatal(err)
	}
	var parts []manifest.Part
	for _, name := range []string{"kernel", "initrd"} {
		p := filepath.Join(dir, "fake-"+name)
		if err := os.WriteFile(p, []byte("fake "+name), 0o644); err != nil {
			t.Fatal(err)
		}
		part, err := st.PutBlob(p)
		if err != nil {
			t.Fatal(err)
		}
		parts = append(parts, part)
	}
	digest, err := st.PutManifest(&manifest.Manifest{SchemaVersion: manifest.SchemaVersion, Name: "fake", Arch: "amd64",
		KernelVersion: "6.1.0-fake", Kernel: parts[0], Initrd: parts[1], Cmdline: "console=ttyS0"})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Tag(tag, digest); err != nil {
		t.Fatal(err)
	}
	return st, digest
}
