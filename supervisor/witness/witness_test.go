package witness

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"

	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/audit/audittest"
)

func newWitness(t *testing.T, name string, logKey string) (*httptest.Server, *Verifier) {
	t.Helper()
	skey, vkey, err := GenerateKey(name)
	if err != nil {
		t.Fatal(err)
	}
	s, err := NewSigner(skey)
	if err != nil {
		t.Fatal(err)
	}
	v, err := NewVerifier(vkey)
	if err != nil {
		t.Fatal(err)
	}
	lv, err := note.NewVerifier(logKey)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(Handler(Config{Signer: s, Logs: map[string]note.Verifier{lv.Name(): lv}, StateDir: t.TempDir()}))
	t.Cleanup(srv.Close)
	return srv, v
}

func TestCosignature(t *testing.T) {
	skey, vkey, err := GenerateKey("w.example/1")
	if err != nil {
		t.Fatal(err)
	}
	s, err := NewSigner(skey)
	if err != nil {
		t.Fatal(err)
	}
	s.Now = func() time.Time { return time.Unix(1700000000, 0) }
	v, err := NewVerifier(vkey)
	if err != nil {
		t.Fatal(err)
	}
	if v.Name() != s.Name() || v.KeyHash() != s.KeyHash() {
		t.Fatalf("signer %s/%08x, verifier %s/%08x", s.Name(), s.KeyHash(), v.Name(), v.KeyHash())
	}
	msg, err := note.Sign(&note.Note{Text: "origin\n1\nAAAA\n"}, s)
	if err != nil {
		t.Fatal(err)
	}
	n, err := note.Open(msg, note.VerifierList(v))
	if err != nil || len(n.Sigs) != 1 {
		t.Fatalf("open: %v %+v", err, n)
	}
	sig := sigBytes(t, n.Sigs[0].Base64)
	if got := Time(sig); !got.Equal(time.Unix(1700000000, 0)) {
		t.Errorf("time %v", got)
	}
	var bad *note.InvalidSignatureError
	if _, err := note.Open(bytes.Replace(msg, []byte("\n1\n"), []byte("\n2\n"), 1), note.VerifierList(v)); !errors.As(err, &bad) {
		t.Errorf("a changed checkpoint: %v, want an invalid signature", err)
	}
	// The time is signed too.
	sig[7]++
	if v.Verify([]byte("origin\n1\nAAAA\n"), sig) {
		t.Error("a cosignature with its time changed verified")
	}
	for _, k := range []string{"", "w+1234abcd", "w+xyz+AAAA", "w+00000000+" + strings.Split(vkey, "+")[2], strings.Replace(vkey, "w.example/1", "other", 1)} {
		if _, err := NewVerifier(k); err == nil {
			t.Errorf("NewVerifier(%q) accepted", k)
		}
	}
	if _, err := NewSigner(vkey); err == nil {
		t.Error("NewSigner took a verifier key")
	}
	if _, _, err := GenerateKey("has space"); err == nil {
		t.Error("a name with a space")
	}
}

func sigBytes(t *testing.T, b64 string) []byte {
	t.Helper()
	raw, err := base64.StdEncoding.DecodeString(b64)
	if err != nil || len(raw) < 4 {
		t.Fatalf("signature %q: %v", b64, err)
	}
	return raw[4:]
}

// logWith opens an audit log in a new directory and appends n records,
// each committed (and checkpointed) on its own.
func logWith(t *testing.T, opts audit.Options, n int) *audit.Log {
	t.Helper()
	opts.CheckpointEvery, opts.CheckpointInterval = 1, 10*time.Millisecond
	l, err := audit.Open(t.TempDir(), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	appendN(t, l, n)
	return l
}

func appendN(t *testing.T, l *audit.Log, n int) {
	t.Helper()
	for i := 0; i < n; i++ {
		data := fmt.Sprintf(`{"procedure":"/x%04d","code":"ok","duration_ns":1}`, l.Size())
		if _, err := l.Append(context.Background(), audit.Record{Kind: audit.KindAPICall, Provenance: audit.Host, Data: []byte(data)}); err != nil {
			t.Fatal(err)
		}
	}
}

// waitCheckpoint waits for the log's checkpoint to cover size.
func waitCheckpoint(t *testing.T, l *audit.Log, size uint64) audit.Checkpoint {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if cp := l.Checkpoint(); cp != nil && cp.Size >= size {
			return *cp
		}
	}
	t.Fatalf("no checkpoint of %d records", size)
	return audit.Checkpoint{}
}

func TestWitnessCosignsOnlyWhatExtends(t *testing.T) {
	l := logWith(t, audit.Options{}, 3)
	srv, wv := newWitness(t, "w1", l.PublicKey())
	c := &Client{URL: srv.URL, Key: wv}
	ctx := context.Background()
	cp3 := waitCheckpoint(t, l, 3)

	// The first: nothing to prove from.
	sig, err := c.AddCheckpoint(ctx, 0, nil, cp3.Note)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(string(sig), "— w1 ") {
		t.Errorf("signature line %q", sig)
	}
	// Proved from an old size the witness does not hold: it says its own.
	var conflict *ConflictError
	if _, err := c.AddCheckpoint(ctx, 0, nil, cp3.Note); !errors.As(err, &conflict) || conflict.Size != cp3.Size {
		t.Errorf("a stale old size: %v, want a conflict at %d", err, cp3.Size)
	}
	appendN(t, l, 4)
	cp7 := waitCheckpoint(t, l, cp3.Size+4)
	proof, err := l.ConsistencyProof(cp3.Size, cp7.Size)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.AddCheckpoint(ctx, cp3.Size, proof, cp7.Note); err != nil {
		t.Fatalf("an extension: %v", err)
	}
	// The same checkpoint again is cosigned again (a retry).
	if _, err := c.AddCheckpoint(ctx, cp7.Size, nil, cp7.Note); err != nil {
		t.Errorf("the same checkpoint again: %v", err)
	}
	// A bad proof, a replayed older checkpoint, a fork at the same size.
	var refused *RefusedError
	bad := append(tlog.TreeProof{}, proof...)
	bad[0][0] ^= 1
	appendN(t, l, 2)
	cp9 := waitCheckpoint(t, l, cp7.Size+2)
	if _, err := c.AddCheckpoint(ctx, cp7.Size, bad, cp9.Note); !errors.As(err, &refused) || refused.Status != http.StatusUnprocessableEntity {
		t.Errorf("a bad proof: %v, want a 422 refusal", err)
	}
	if _, err := c.AddCheckpoint(ctx, cp7.Size, nil, cp3.Note); !errors.As(err, &refused) || !strings.Contains(refused.Reason, "smaller") {
		t.Errorf("a replayed older checkpoint: %v", err)
	}
	forked, err := audittest.SignCheckpoint(l.Dir(), cp7.Size, tlog.Hash{1})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.AddCheckpoint(ctx, cp7.Size, nil, forked); !errors.As(err, &refused) || !strings.Contains(refused.Reason, "forked") {
		t.Errorf("a fork: %v", err)
	}
	// A checkpoint not signed by the log's key, or of a log it does not know.
	other := logWith(t, audit.Options{}, 1)
	ocp := waitCheckpoint(t, other, 1)
	if _, err := c.AddCheckpoint(ctx, cp7.Size, nil, ocp.Note); !errors.As(err, &refused) || refused.Status != http.StatusForbidden {
		t.Errorf("another key's checkpoint: %v", err)
	}
}

func TestWitnessRequestsCapped(t *testing.T) {
	l := logWith(t, audit.Options{}, 1)
	srv, _ := newWitness(t, "w1", l.PublicKey())
	for _, c := range []struct {
		body   string
		status int
	}{
		{"", http.StatusBadRequest},
		{"old x\n\n", http.StatusBadRequest},
		{"old 01\n\n", http.StatusBadRequest},
		{"old 0\nnot-base64\n\n", http.StatusBadRequest},
		{"old 0\n" + strings.Repeat(tlog.Hash{}.String()+"\n", maxProofHashes+1) + "\n", http.StatusBadRequest},
		{"old 0\n\nunknown-log\n1\n" + tlog.Hash{}.String() + "\n\n— x AAAA\n", http.StatusNotFound},
		{"old 0\n\n" + strings.Repeat("x", maxRequestBytes), http.StatusRequestEntityTooLarge},
	} {
		resp, err := http.Post(srv.URL+"/add-checkpoint", "text/plain", strings.NewReader(c.body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != c.status {
			t.Errorf("%.40q: %d, want %d", c.body, resp.StatusCode, c.status)
		}
	}
}

// A witness that answers garbage, too much, or too slowly is an error the
// caller sees, within its bound.
func TestClientRefusesBadAnswers(t *testing.T) {
	l := logWith(t, audit.Options{}, 1)
	cp := waitCheckpoint(t, l, 1)
	_, vkey, _ := GenerateKey("w1")
	wv, _ := NewVerifier(vkey)
	for name, h := range map[string]http.HandlerFunc{
		"garbage":       func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("hello\n")) },
		"a wrong cosig": func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("— w1 AAAAAAAAAAAAAAAA\n")) },
		"too much":      func(w http.ResponseWriter, r *http.Request) { w.Write(bytes.Repeat([]byte("x"), maxResponseBytes+10)) },
		"409 without size": func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusConflict)
			w.Write([]byte("what"))
		},
		"500": func(w http.ResponseWriter, r *http.Request) { http.Error(w, "down\x1b[31m", 500) },
		"another's line too": func(w http.ResponseWriter, r *http.Request) {
			w.Write([]byte("— w1 AAAAAAAAAAAAAAAA\n— w2 AAAAAAAAAAAAAAAA\n"))
		},
	} {
		srv := httptest.NewServer(h)
		_, err := (&Client{URL: srv.URL, Key: wv}).AddCheckpoint(context.Background(), 0, nil, cp.Note)
		srv.Close()
		if err == nil {
			t.Errorf("%s: accepted", name)
		} else if strings.ContainsRune(err.Error(), 0x1b) {
			t.Errorf("%s: the witness's escape reached the error: %q", name, err)
		}
	}
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { time.Sleep(2 * time.Second) }))
	defer slow.Close()
	start := time.Now()
	_, err := (&Client{URL: slow.URL, Key: wv, HTTP: &http.Client{Timeout: 200 * time.Millisecond}}).AddCheckpoint(context.Background(), 0, nil, cp.Note)
	if err == nil || time.Since(start) > time.Second {
		t.Errorf("a slow witness: %v after %v", err, time.Since(start))
	}
}

// TestPusherAndTheRewriteAttack: a log's checkpoints get cosigned as they
// come, a witness that is down holds nothing up and is recorded, and a
// host that rewrites a record and signs every later checkpoint again with
// its own key passes a plain verify but not one that asks for the
// witness.
func TestPusherAndTheRewriteAttack(t *testing.T) {
	var events []Event
	var mu sync.Mutex
	p := &Pusher{Record: func(_ context.Context, ev Event) { mu.Lock(); events = append(events, ev); mu.Unlock() }}
	l := logWith(t, audit.Options{OnCheckpoint: func(cp audit.Checkpoint) { p.Checkpoint(cp) }}, 0)
	lv, _ := note.NewVerifier(l.PublicKey())
	srv, wv := newWitness(t, "w1", l.PublicKey())
	down := true
	var downMu sync.Mutex
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		downMu.Lock()
		d := down
		downMu.Unlock()
		if d {
			http.Error(w, "down for maintenance", http.StatusServiceUnavailable)
			return
		}
		srv.Config.Handler.ServeHTTP(w, r)
	}))
	defer front.Close()
	p.Dir, p.LogKey, p.Proof = l.Dir(), lv, l.ConsistencyProof
	p.Witnesses = []Target{{Client: &Client{URL: front.URL, Key: wv}}}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go p.Run(ctx)

	appendN(t, l, 5)
	waitCheckpoint(t, l, 5)
	waitFor(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(events) == 1 })
	if events[0].Err == nil || events[0].Witness != "w1" {
		t.Errorf("the first event %+v, want the failure", events[0])
	}
	appendN(t, l, 3) // the log goes on
	downMu.Lock()
	down = false
	downMu.Unlock()
	appendN(t, l, 2)
	last := waitCheckpoint(t, l, 10)
	waitFor(t, func() bool {
		rep, err := audit.Verify(l.Dir(), audit.VerifyOptions{Witnesses: []note.Verifier{wv}})
		return err == nil && rep.Witnessed == last.Size
	})
	// The recovery is recorded once the cosignature is kept.
	waitFor(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(events) >= 2 })
	mu.Lock()
	if len(events) != 2 || events[1].Err != nil {
		t.Errorf("events %+v, want the failure then the recovery", events)
	}
	mu.Unlock()
	cancel()
	l.Close()

	rep, err := audit.Verify(l.Dir(), audit.VerifyOptions{Witnesses: []note.Verifier{wv}})
	if err != nil || !rep.OK() {
		t.Fatalf("the witnessed log: %v %+v", err, rep)
	}
	if len(rep.Unwitnessed) == 0 {
		t.Error("no checkpoint reported unwitnessed: those of the witness's downtime are")
	}

	// The rewrite: record 6 changed, every checkpoint from 7 records on
	// signed again by the host's key over the new tree, the witness's
	// cosignatures left on them.
	if err := audittest.RewriteRecord(l.Dir(), 6); err != nil {
		t.Fatal(err)
	}
	if rep, err := audit.Verify(l.Dir(), audit.VerifyOptions{}); err != nil || !rep.OK() {
		t.Fatalf("the rewritten log, verified by the host's key alone, should pass: %v %+v", err, rep)
	}
	rep, err = audit.Verify(l.Dir(), audit.VerifyOptions{Witnesses: []note.Verifier{wv}})
	if err != nil {
		t.Fatal(err)
	}
	var first *audit.Problem
	for i, pr := range rep.Problems {
		if pr.Kind == audit.ProblemCosignature {
			first = &rep.Problems[i]
			break
		}
	}
	// The witness was down until the last checkpoint: the first one it
	// cosigned, and the first the rewrite breaks, is that one.
	if first == nil || *first.Checkpoint != last.Size || !strings.Contains(first.Detail, "witness w1 does not match") {
		t.Errorf("with the witness: %+v, want the cosignature of checkpoint %d refused", rep.Problems, last.Size)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatal("timed out")
}

// FuzzParseRequest: whatever a client sends the witness is refused or
// read within the caps, never a panic.
func FuzzParseRequest(f *testing.F) {
	f.Add([]byte("old 0\n\norigin\n1\nAAAA\n\n— x AAAA\n"))
	f.Add([]byte("old 5\n" + tlog.Hash{}.String() + "\n\nx"))
	f.Add([]byte("old \n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := parseRequest(b)
		if err != nil {
			return
		}
		if len(r.proof) > maxProofHashes || len(r.checkpoint) > len(b) {
			t.Fatalf("%d proof hashes, %d checkpoint bytes from %d", len(r.proof), len(r.checkpoint), len(b))
		}
	})
}
