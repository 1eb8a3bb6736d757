package tests

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/image/store"
	"github.com/carrel-os/carrel/tests/harness"
)

// openStore opens the daemon's image store, as a second writer: the store
// is safe for that (every write is an atomic rename).
func openStore(t *testing.T, d *harness.Daemon) *store.Store {
	t.Helper()
	st, err := store.Open(filepath.Join(d.State, "images"))
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// brokenImage stores a copy of the dev image under tag with its kernel
// command line and/or initrd replaced, and returns its digest.
func brokenImage(t *testing.T, st *store.Store, tag, cmdline string, initrd []byte) string {
	t.Helper()
	dev, err := st.Resolve("dev")
	if err != nil {
		t.Fatal(err)
	}
	m := *dev.Manifest
	if cmdline != "" {
		m.Cmdline = cmdline
	}
	if initrd != nil {
		p := filepath.Join(t.TempDir(), "initrd")
		if err := os.WriteFile(p, initrd, 0o644); err != nil {
			t.Fatal(err)
		}
		part, err := st.PutBlob(p)
		if err != nil {
			t.Fatal(err)
		}
		m.Initrd = part
	}
	digest, err := st.PutManifest(&m)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Tag(tag, digest); err != nil {
		t.Fatal(err)
	}
	return digest
}

// devCmdline is the dev image's kernel command line.
func devCmdline(t *testing.T, st *store.Store) string {
	t.Helper()
	dev, err := st.Resolve("dev")
	if err != nil {
		t.Fatal(err)
	}
	return dev.Manifest.Cmdline
}

// wrongRootHash stores, under tag, the dev image with another root hash,
// in its verity record and on its command line alike: a manifest that
// import would refuse, written straight into the store as a damaged or
// forged store would hold it. It returns the digest.
func wrongRootHash(t *testing.T, st *store.Store, tag string) string {
	t.Helper()
	dev, err := st.Resolve("dev")
	if err != nil {
		t.Fatal(err)
	}
	m := *dev.Manifest
	v := *m.Verity
	wrong := strings.Repeat("0", 63) + "1"
	m.Cmdline = strings.Replace(m.Cmdline, "roothash="+v.RootHash, "roothash="+wrong, 1)
	v.RootHash = wrong
	m.Verity = &v
	digest, err := st.PutManifest(&m)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Tag(tag, digest); err != nil {
		t.Fatal(err)
	}
	return digest
}
