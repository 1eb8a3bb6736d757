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

	stored := func(digest string) bool {
		p, _ := audit.BlobPath(dir, digest)
		_, err := os.Stat(p)
		return err == nil
	}
	chunk := bytes.Repeat([]byte{'x'}, 1<<20)
	var atCap [][]byte
	for range maxRecordedWrite >> 20 {
		atCap = append(atCap, chunk)
	}
	d := digest(bytes.Join(atCap, nil))
	if blob, why := keep(atCap, d, false); blob != d || why != "" || !stored(d) {
		t.Errorf("content of exactly %d bytes: kept %q, %q", maxRecordedWrite, blob, why)
	}
	over := append(atCap, []byte("y"))
	if blob, why := keep(over, digest(bytes.Join(over, nil)), false); blob != "" || why != "not kept: over 16 MiB" || stored(digest(bytes.Join(over, nil))) {
		t.Errorf("over the cap: %q, %q", blob, why)
	}
	abandoned := []byte("a write that did not happen")
	if blob, why := keep([][]byte{abandoned}, digest(abandoned), true); blob != "" || why != "" || stored(digest(abandoned)) {
		t.Errorf("abandoned: %q, %q", blob, why)
	}
	unnamed := []byte("content without a digest")
	if blob, why := keep([][]byte{unnamed}, "", false); blob != "" || !strings.HasPrefix(why, "not kept: blob name") || stored(digest(unnamed)) {
		t.Errorf("no digest: %q, %q", blob, why)
	}
	noTemps()

	// Finish again gives the same answer.
	b := c.Content()
	b.Write(want)
	first, _ := b.Finish(digest(want), false)
	if again, why := b.Finish(digest(want), false); again != first || why != "" {
		t.Errorf("Finish twice: %q then %q, %q", first, again, why)
	}

	// A log that cannot start a blob: the write goes on, its content is
	// not kept, and the record says why.
	var ml memLog
	mb := New(&ml, nil).Call("vm", "ses", audit.Caller{}).Content()
	mb.Write(want)
	if blob, why := mb.Finish(digest(want), false); blob != "" || why != "not kept: memLog keeps no blobs" {
		t.Errorf("no blob store: %q, %q", blob, why)
	}
	var nilContent *Content
	nilContent.Write(want)
	if blob, why := nilContent.Finish(digest(want), false); blob != "" || why != "" {
		t.Errorf("nil Content: %q, %q", blob, why)
	}
}
