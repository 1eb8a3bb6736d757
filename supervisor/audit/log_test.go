package audit

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/mod/sumdb/tlog"
)

func TestRoundTrip(t *testing.T) {
	dir := t.TempDir()
	l := openLog(t, dir, Options{CheckpointEvery: 10})
	ctx := context.Background()
	digest, err := l.PutBlob(strings.NewReader("hello, output\n"))
	if err != nil {
		t.Fatal(err)
	}
	p, err := l.Begin(ctx, Record{VM: "demo", Session: "s1", Provenance: Host, Data: json.RawMessage(`{"action":"exec","argv":["true"]}`)})
	if err != nil {
		t.Fatal(err)
	}
	out, err := l.Append(ctx, Record{Kind: KindExecOutput, VM: "demo", Session: "s1", Provenance: Guest, Blobs: []string{digest}})
	if err != nil {
		t.Fatal(err)
	}
	end, err := p.End(ctx, Record{Provenance: Host, Data: json.RawMessage(`{"exit":0}`)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.End(ctx, Record{Provenance: Host}); !errors.Is(err, ErrEnded) {
		t.Errorf("second End: %v", err)
	}
	if p.Seq() != 0 || out != 1 || end != 2 {
		t.Errorf("seqs %d %d %d", p.Seq(), out, end)
	}
	appendN(t, l, 20)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); !errors.Is(err, ErrClosed) {
		t.Errorf("second Close: %v", err)
	}
	if _, err := l.Append(ctx, sample(0)); !errors.Is(err, ErrClosed) {
		t.Errorf("append after Close: %v", err)
	}

	var got []Record
	var off []int64
	if err := Scan(dir, func(seq uint64, o int64, payload []byte) error {
		r, err := Decode(payload)
		got = append(got, r)
		off = append(off, o)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if len(got) != 23 {
		t.Fatalf("%d records", len(got))
	}
	if got[0].Kind != KindIntent || got[2].Kind != KindOutcome || got[2].Intent == nil || *got[2].Intent != 0 || got[2].VM != "demo" || got[2].Session != "s1" {
		t.Errorf("intent and outcome: %+v %+v", got[0], got[2])
	}
	if got[1].Blobs[0] != digest || got[1].Provenance != Guest {
		t.Errorf("output record: %+v", got[1])
	}
	for i, r := range got {
		if r.Seq != uint64(i) || r.Time.Location() != time.UTC || time.Since(r.Time) > time.Minute {
			t.Errorf("record %d: seq %d time %v", i, r.Seq, r.Time)
		}
	}
	rep := mustVerify(t, dir)
	if rep.Records != 23 || rep.Latest != 23 || rep.Blobs != 1 || rep.OpenIntents != 0 || !rep.KeyFromLog {
		t.Errorf("report %+v", rep)
	}
	// Checkpoints at 10 and 20 records and on Close.
	sizes, _ := listCheckpoints(dir)
	if !slices.Equal(sizes, []uint64{10, 20, 23}) {
		t.Errorf("checkpoints at %v", sizes)
	}
	st, err := os.Stat(filepath.Join(dir, keyFile))
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("key: %v %v", st.Mode(), err)
	}

	// Reopen: appends continue where they were, nothing to recover.
	l = openLog(t, dir, Options{})
	defer l.Close()
	if rc := l.Recovered(); rc.Records != 23 || rc.TruncatedBytes != 0 || len(rc.UnknownOutcomes) != 0 || rc.Checkpoint != 23 || rc.HashesFrom != 23 {
		t.Errorf("recovered %+v", rc)
	}
	if s, err := l.Append(ctx, sample(0)); err != nil || s != 23 {
		t.Errorf("append after reopen: %d %v", s, err)
	}
	if _, err := Open(dir, Options{Logger: quiet}); !errors.Is(err, ErrLocked) {
		t.Errorf("second Open: %v", err)
	}
}

func TestConcurrentAppendersAreDense(t *testing.T) {
	dir := t.TempDir()
	l := openLog(t, dir, Options{CheckpointEvery: 100})
	const writers, each = 32, 100
	var mu sync.Mutex
	seen := map[uint64]int{}
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for i := range each {
				s, err := l.Append(context.Background(), sample(w*each+i))
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				seen[s]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	for s := range uint64(writers * each) {
		if seen[s] != 1 {
			t.Fatalf("seq %d returned %d times", s, seen[s])
		}
	}
	if l.Size() != writers*each {
		t.Errorf("size %d", l.Size())
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	rep := mustVerify(t, dir)
	if rep.Records != writers*each || rep.Latest != writers*each {
		t.Errorf("report %+v", rep)
	}
}

func TestProofs(t *testing.T) {
	dir := t.TempDir()
	l := openLog(t, dir, Options{})
	defer l.Close()
	appendN(t, l, 37)
	var payloads [][]byte
	Scan(dir, func(_ uint64, _ int64, p []byte) error {
		payloads = append(payloads, bytes.Clone(p))
		return nil
	})
	for _, size := range []uint64{1, 2, 16, 37} {
		root, err := l.TreeHash(size)
		if err != nil {
			t.Fatal(err)
		}
		for seq := range size {
			p, err := l.Proof(seq, size)
			if err != nil {
				t.Fatal(err)
			}
			if err := CheckProof(p, size, root, seq, payloads[seq]); err != nil {
				t.Errorf("proof of %d in %d: %v", seq, size, err)
			}
			if CheckProof(p, size, root, seq, append(bytes.Clone(payloads[seq]), ' ')) == nil {
				t.Errorf("proof of %d in %d checks a changed record", seq, size)
			}
		}
		if size > 1 {
			old, _ := l.TreeHash(size / 2)
			tp, err := l.ConsistencyProof(size/2, size)
			if err != nil {
				t.Fatal(err)
			}
			if err := tlog.CheckTree(tp, int64(size), root, int64(size/2), old); err != nil {
				t.Errorf("consistency %d..%d: %v", size/2, size, err)
			}
		}
	}
	if _, err := l.Proof(0, 38); err == nil {
		t.Error("proof beyond the log")
	}
}

// A checkpoint comes on the timer when records are fewer than
// CheckpointEvery, and is valid for the key Open created.
func TestCheckpointOnTimer(t *testing.T) {
	dir := t.TempDir()
	l := openLog(t, dir, Options{CheckpointInterval: 20 * time.Millisecond})
	defer l.Close()
	appendN(t, l, 3)
	deadline := time.Now().Add(5 * time.Second)
	for l.Checkpoint() == nil || l.Checkpoint().Size != 3 {
		if time.Now().After(deadline) {
			t.Fatalf("no checkpoint: %+v", l.Checkpoint())
		}
		time.Sleep(5 * time.Millisecond)
	}
	pub, err := PublicKey(dir)
	if err != nil || pub != l.PublicKey() {
		t.Fatalf("public key %q %v", pub, err)
	}
	cp, err := ParseCheckpoint(readFile(t, filepath.Join(dir, checkpointDir, checkpointName(3))), pub)
	if err != nil {
		t.Fatal(err)
	}
	root, _ := l.TreeHash(3)
	if cp.Size != 3 || cp.Root != root {
		t.Errorf("checkpoint %d %v, tree %v", cp.Size, cp.Root, root)
	}
	if !strings.HasPrefix(string(cp.Note), "carrel-audit\n3\n") {
		t.Errorf("note %q", cp.Note)
	}
}

func TestAppendChecks(t *testing.T) {
	l := openLog(t, t.TempDir(), Options{})
	defer l.Close()
	ctx := context.Background()
	missing := "sha256:" + strings.Repeat("0", 64)
	if _, err := l.Append(ctx, Record{Kind: "x", Provenance: Host, Blobs: []string{missing}}); !errors.Is(err, ErrInvalid) {
		t.Errorf("missing blob: %v", err)
	}
	in := uint64(5)
	if _, err := l.Append(ctx, Record{Kind: KindOutcome, Provenance: Host, Intent: &in}); !errors.Is(err, ErrInvalid) {
		t.Errorf("intent beyond the log: %v", err)
	}
	if _, err := l.Begin(ctx, Record{Kind: KindExecStart, Provenance: Host}); !errors.Is(err, ErrInvalid) {
		t.Errorf("Begin with another kind: %v", err)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := l.Append(cctx, sample(0)); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled: %v", err)
	}
	if l.Size() != 0 {
		t.Errorf("size %d", l.Size())
	}
}

func TestBlobs(t *testing.T) {
	dir := t.TempDir()
	l := openLog(t, dir, Options{})
	defer l.Close()
	big := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB, streamed
	d1, err := l.PutBlob(bytes.NewReader(big))
	if err != nil {
		t.Fatal(err)
	}
	d2, err := l.PutBlob(bytes.NewReader(big))
	if err != nil || d2 != d1 {
		t.Fatalf("same content: %s %s %v", d1, d2, err)
	}
	f, err := l.OpenBlob(d1)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, _ := f.Stat()
	if st.Size() != int64(len(big)) || checkBlob(dir, d1) != nil {
		t.Errorf("blob size %d", st.Size())
	}
	if left, _ := filepath.Glob(filepath.Join(dir, blobDir, ".put-*")); len(left) != 0 {
		t.Errorf("temporary files left: %v", left)
	}
	if _, err := BlobPath(dir, "sha256:../../x"); !errors.Is(err, ErrInvalid) {
		t.Errorf("bad digest: %v", err)
	}
}

// TestOrigin: a new log's key, and so its checkpoints' first line, is
// named by Options.Origin; the log verifies; reopened under another
// origin it refuses, since the origin is set when the log is made.
func TestOrigin(t *testing.T) {
	dir := t.TempDir()
	l := openLog(t, dir, Options{Origin: "carrel.example.com/host1"})
	appendN(t, l, 3)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	sizes, err := listCheckpoints(dir)
	if err != nil || len(sizes) == 0 {
		t.Fatalf("checkpoints %v %v", sizes, err)
	}
	cp := readFile(t, filepath.Join(dir, checkpointDir, checkpointName(sizes[len(sizes)-1])))
	if !strings.HasPrefix(string(cp), "carrel.example.com/host1\n3\n") || !strings.HasPrefix(readPub(t, dir), "carrel.example.com/host1+") {
		t.Errorf("checkpoint %q", cp)
	}
	mustVerify(t, dir)
	if _, err := Open(dir, Options{Logger: quiet}); err == nil || !strings.Contains(err.Error(), `named "carrel.example.com/host1", not "carrel-audit"`) {
		t.Errorf("reopened with the default origin: %v", err)
	}
	l, err = Open(dir, Options{Logger: quiet, Origin: "carrel.example.com/host1"})
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
}

func readPub(t *testing.T, dir string) string {
	t.Helper()
	k, err := PublicKey(dir)
	if err != nil {
		t.Fatal(err)
	}
	return k
}
