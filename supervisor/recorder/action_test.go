package recorder

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/supervisor/audit"
)

// TestContent: a write's content is kept as a blob named by the digest
// the relay gives, and only then; content over the cap, a write given up,
// or a bad digest keep nothing, and no temp file is left in the store.
func TestContent(t *testing.T) {
	dir := t.TempDir()
	log, err := audit.Open(dir, audit.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	c := New(log, nil).Call("vm", "ses", audit.Caller{})
	digest := func(b []byte) string {
		sum := sha256.Sum256(b)
		return "sha256:" + hex.EncodeToString(sum[:])
	}
	keep := func(parts [][]byte, digest string, abort bool) (string, string) {
		b := c.Content()
		for _, p := range parts {
			b.Write(p)
		}
		return b.Finish(digest, abort)
	}
	noTemps := func() {
		t.Helper()
		temps, _ := filepath.Glob(filepath.Join(dir, "blobs", ".put-*"))
		if len(temps) != 0 {
			t.Errorf("temp files left: %q", temps)
		}
	}

	small := [][]byte{[]byte("hello, "), nil, []byte("world")}
	want := []byte("hello, world")
	blob, why := keep(small, digest(want), false)
	if blob != digest(want) || why != "" {
		t.Fatalf("kept %q, %q; want %s", blob, why, digest(want))
	}
	p, err := audit.BlobPath(dir, blob)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(p); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("blob holds %q, %v", got, err)
	}
	if blob, why := keep(nil, digest(nil), false); blob != digest(nil) || why != "" {
		t.Errorf("empty write: %q, %q", blob, why)
	}

	chunk := bytes.Repeat([]byte{'x'}, 1<<20)
	var big [][]byte
	for range maxRecordedWrite>>20 + 1 {
		big = append(big, chunk)
	}
	if blob, why := keep(big, digest(bytes.Join(big, nil)), false); blob != "" || why != "not kept: over 16 MiB" {
		t.Errorf("over the cap: %q, %q", blob, why)
	}
	if blob, why := keep(small, digest(want), true); blob != "" || why != "" {
		t.Errorf("abandoned: %q, %q", blob, why)
	}
	if blob, why := keep(small, "", false); blob != "" || !strings.HasPrefix(why, "not kept: blob name") {
		t.Errorf("no digest: %q, %q", blob, why)
	}
	noTemps()
	var nilContent *Content
	nilContent.Write(want)
	if blob, why := nilContent.Finish(digest(want), false); blob != "" || why != "" {
		t.Errorf("nil Content: %q, %q", blob, why)
	}
}
