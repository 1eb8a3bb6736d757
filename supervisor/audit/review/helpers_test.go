package review

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/image/verity"
	"github.com/carrel-os/carrel/supervisor/audit"
)

var quiet = slog.New(slog.DiscardHandler)

const (
	testSession  = "ses_0123456789abcdef"
	testVM       = "demo"
	testRootHash = "bc1b8827daf7" + "0123456789abcdef0123456789abcdef0123456789abcdef0123"
)

// testManifest is the sample session's image manifest, with a verified
// root and three packages; testImage is its digest.
var testManifest, testImage = sampleManifest(nil)

var testPackages = []manifest.Package{
	{Name: "bash", Version: "5.2.15-2+b7", Arch: "amd64"},
	{Name: "coreutils", Version: "9.1-1", Arch: "amd64"},
	{Name: "python3.11", Version: "3.11.2-6", Arch: "amd64"},
}

// sampleManifest encodes an image manifest named "agent" with a verified
// root whose root hash is testRootHash, and these packages (default
// testPackages), and gives its digest.
func sampleManifest(pkgs []manifest.Package) ([]byte, string) {
	if pkgs == nil {
		pkgs = testPackages
	}
	v := &manifest.Verity{Mount: manifest.MountRoot, RootHash: testRootHash, HashAlg: "sha256", DataBlockSize: 4096, HashBlockSize: 4096,
		DataBlocks: 256, Salt: strings.Repeat("01", 32), UUID: "6361726c-0000-8000-8000-000000000001"}
	p, _, err := v.Params()
	if err != nil {
		panic(err)
	}
	m := &manifest.Manifest{SchemaVersion: manifest.SchemaVersion, Name: "agent", Arch: "amd64", KernelVersion: "6.1.0-28-amd64",
		Kernel:       manifest.Part{Digest: manifest.DigestBytes([]byte("kernel")), Size: 6},
		Initrd:       manifest.Part{Digest: manifest.DigestBytes([]byte("initrd")), Size: 6},
		Cmdline:      "console=ttyS0 roothash=" + testRootHash,
		System:       &manifest.Part{Digest: manifest.DigestBytes([]byte("system")), Size: 256 * 4096},
		SystemVerity: &manifest.Part{Digest: manifest.DigestBytes([]byte("hash")), Size: verity.HashSize(p)},
		Verity:       v,
		Packages:     pkgs,
	}
	b, err := m.Marshal()
	if err != nil {
		panic(err)
	}
	return b, manifest.DigestBytes(b)
}

// sampleLog is a log with one session of a VM, written as carreld does
// (docs/audit.md), with another VM's session interleaved.
type sampleLog struct {
	dir string
	// Commands: the intent seqs, and what each wrote, in the order the
	// records hold it.
	echo, script, sleeper uint64
	echoOut               []byte
	scriptOut, scriptErr  []byte
	denySeq, looseSeq     uint64
	writeSeq, fileOpSeq   uint64
	lateLoose, otherSeq   uint64
	watchSeq              uint64
	writeBlob             string
	stopSeq               uint64
	// The session's starting record keeps the image's manifest as a
	// blob; its started record names the image by digest only.
	startingSeq, startedSeq uint64
}

type writer struct {
	t   testing.TB
	l   *audit.Log
	ctx context.Context
}

func (w *writer) data(v any) json.RawMessage {
	b, err := json.Marshal(v)
	if err != nil {
		w.t.Fatal(err)
	}
	return b
}

func (w *writer) append(rec audit.Record) uint64 {
	w.t.Helper()
	if rec.Provenance == "" {
		rec.Provenance = audit.Host
	}
	seq, err := w.l.Append(w.ctx, rec)
	if err != nil {
		w.t.Fatalf("append %s: %v", rec.Kind, err)
	}
	return seq
}

func (w *writer) blob(b []byte) string {
	w.t.Helper()
	d, err := w.l.PutBlob(bytes.NewReader(b))
	if err != nil {
		w.t.Fatal(err)
	}
	return d
}

func (w *writer) decision(session string, allow bool, kind, rule, reason string) uint64 {
	return w.append(audit.Record{Kind: audit.KindPolicyDecision, VM: testVM, Session: session,
		Data: w.data(map[string]any{"id": fmt.Sprintf("dec-%s-%v", rule, allow), "kind": kind, "policy": "default", "revision": "rev-7",
			"input_digest": "sha256:2222222222222222222222222222222222222222222222222222222222222222", "allow": allow, "rule": rule, "reason": reason,
			"input": map[string]any{"argv": []string{"x"}}})})
}

// exec records a command the way the API does: the intent, its output
// records (stream, the bytes, and chunk sizes with their ns offsets),
// and its exit.
func (w *writer) exec(argv []string, tty bool, outs []execOut, code int) uint64 {
	w.t.Helper()
	p, err := w.l.Begin(w.ctx, audit.Record{VM: testVM, Session: testSession, Provenance: audit.Host,
		Data: w.data(map[string]any{"action": "exec", "caller": map[string]any{"type": "peer", "uid": 1000, "pid": 4242},
			"argv": argv, "cwd": "/workspace", "user": "agent", "tty": tty})})
	if err != nil {
		w.t.Fatal(err)
	}
	offs := map[string]int{}
	sizes := map[string]int{}
	for _, o := range outs {
		var chunks [][2]int64
		for i, n := range o.chunks {
			chunks = append(chunks, [2]int64{o.ns[i], int64(n)})
		}
		w.append(audit.Record{Kind: audit.KindExecOutput, VM: testVM, Session: testSession, Blobs: []string{w.blob(o.data)},
			Data: w.data(map[string]any{"exec": p.Seq(), "stream": o.stream, "offset": offs[o.stream], "size": len(o.data), "chunks": chunks})})
		offs[o.stream] += len(o.data)
		sizes[o.stream] += len(o.data)
	}
	if _, err := p.End(w.ctx, audit.Record{Kind: audit.KindExecExit, Provenance: audit.Host,
		Data: w.data(map[string]any{"code": code, "stdout_bytes": sizes["stdout"], "stderr_bytes": sizes["stderr"]})}); err != nil {
		w.t.Fatal(err)
	}
	return p.Seq()
}

type execOut struct {
	stream string
	data   []byte
	chunks []int   // sizes, summing to len(data)
	ns     []int64 // when each chunk came, since the exec began
}

// newSampleLog writes the sample log and closes it (which signs a
// checkpoint over all of it).
func newSampleLog(t testing.TB) *sampleLog {
	t.Helper()
	return newSampleLogWith(t, audit.Options{})
}

// newSampleLogWith is newSampleLog with opts (segments of a size, say).
func newSampleLogWith(t testing.TB, opts audit.Options) *sampleLog {
	t.Helper()
	s := &sampleLog{dir: t.TempDir()}
	opts.Logger, opts.CheckpointInterval = quiet, time.Hour
	l, err := audit.Open(s.dir, opts)
	if err != nil {
		t.Fatal(err)
	}
	w := &writer{t: t, l: l, ctx: context.Background()}
	w.append(audit.Record{Kind: audit.KindVMLifecycle, VM: "other", Session: "ses_ffffffffffffffff", Data: w.data(map[string]any{"event": "started"})})
	w.append(audit.Record{Kind: audit.KindVMLifecycle, VM: testVM, Data: w.data(map[string]any{"event": "created"})}) // before the session: not its
	s.startingSeq = w.append(audit.Record{Kind: audit.KindVMLifecycle, VM: testVM, Session: testSession, Blobs: []string{w.blob(testManifest)},
		Data: w.data(map[string]any{"event": "starting", "image_digest": testImage, "image_name": "agent", "root_hash": testRootHash,
			"policy": "default", "policy_revision": "rev-7", "memory_bytes": 2 << 30, "cpus": 2, "driver": "qemu"})})
	s.startedSeq = w.append(audit.Record{Kind: audit.KindVMLifecycle, VM: testVM, Session: testSession,
		Data: w.data(map[string]any{"event": "started", "image_digest": testImage, "root_hash": testRootHash, "policy": "default", "policy_revision": "rev-7",
			"memory_bytes": 2 << 30, "cpus": 2, "driver": "qemu"})})
	w.decision(testSession, true, "exec", "allow_exec", "commands in /workspace are allowed")

	// "héllo wörld ✓\n", its "ö" and "✓" split between chunks.
	s.echoOut = []byte("héllo wörld ✓\n")
	cut1 := bytes.Index(s.echoOut, []byte("ö")) + 1
	cut2 := bytes.Index(s.echoOut, []byte("✓")) + 2
	s.echo = w.exec([]string{"echo", "héllo wörld ✓"}, false, []execOut{
		{"stdout", s.echoOut, []int{cut1, cut2 - cut1, len(s.echoOut) - cut2}, []int64{1e6, 2e6, 250e6}},
	}, 0)

	s.otherSeq = w.append(audit.Record{Kind: audit.KindAPICall, VM: "other", Session: "ses_ffffffffffffffff", Data: w.data(map[string]any{"procedure": "/carrel.api.v1.ExecService/Exec", "code": "ok"})})
	s.denySeq = w.decision(testSession, false, "exec", "deny_network", "no egress for curl")
	// A decision that names the VM but no session, while the session runs.
	s.looseSeq = w.decision("", true, "file.write", "allow_workspace_writes", "in the workspace")

	// Output with markup, colour, a clipboard write and a status query.
	s.scriptOut = []byte("<script>alert(1)</script>\n\x1b[31mred\x1b[0m\n\x1b]52;c;ZXZpbA==\x07\x1b[6n")
	s.scriptErr = []byte("err: </pre><b>bold</b>\n")
	s.script = w.exec([]string{"sh", "-c", "printf '<script>'\x1b]0;title\x07"}, false, []execOut{
		{"stdout", s.scriptOut, []int{10, len(s.scriptOut) - 10}, []int64{5e6, 60e9}},
		{"stderr", s.scriptErr, []int{len(s.scriptErr)}, []int64{20e9}},
	}, 1)

	content := []byte("hello")
	p, err := l.Begin(w.ctx, audit.Record{VM: testVM, Session: testSession, Provenance: audit.Host,
		Data: w.data(map[string]any{"action": "file.write", "caller": map[string]any{"type": "peer", "uid": 1000}, "path": "/workspace/a.txt", "mode": 420})})
	if err != nil {
		t.Fatal(err)
	}
	s.writeSeq = p.Seq()
	s.writeBlob = w.blob(content)
	if s.fileOpSeq, err = p.End(w.ctx, audit.Record{Kind: audit.KindFileOp, Provenance: audit.Host, Blobs: []string{s.writeBlob},
		Data: w.data(map[string]any{"op": "write", "path": "/workspace/a.txt", "size": len(content), "digest": s.writeBlob})}); err != nil {
		t.Fatal(err)
	}
	w.append(audit.Record{Kind: "file.activity", VM: testVM, Session: testSession, Provenance: audit.Guest,
		Data: w.data(map[string]any{"events": []map[string]any{{"op": "modify", "path": "/workspace/a.txt", "pid": 77, "exec_id": "x1", "ns": 5}}, "dropped": 0})})
	s.watchSeq = w.append(audit.Record{Kind: audit.KindWatchEvent, VM: testVM, Session: testSession, Provenance: audit.Guest,
		Data: w.data(map[string]any{"watch": "dec-w", "events": []map[string]any{{"op": "create", "path": "/workspace/new.txt", "time_ns": 1},
			{"op": "rename", "path": "/workspace/b", "old_path": "/workspace/a", "time_ns": 2}}, "dropped": 2})})
	s.sleeper = w.exec([]string{"sleep", "1"}, true, nil, 0)
	s.stopSeq = w.append(audit.Record{Kind: audit.KindVMLifecycle, VM: testVM, Session: testSession, Data: w.data(map[string]any{"event": "stopped"})})
	s.lateLoose = w.append(audit.Record{Kind: audit.KindVMLifecycle, VM: testVM, Data: w.data(map[string]any{"event": "removed"})}) // after the session
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return s
}

func openReader(t testing.TB, dir string) *audit.Reader {
	t.Helper()
	r, err := audit.OpenReader(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

func loadSample(t testing.TB, s *sampleLog) (*audit.Reader, *Session) {
	t.Helper()
	r := openReader(t, s.dir)
	sess, err := LoadSession(r, testSession)
	if err != nil {
		t.Fatal(err)
	}
	return r, sess
}

func (s *Session) entry(seq uint64) *Entry {
	for i := range s.Entries {
		if s.Entries[i].Seq == seq {
			return &s.Entries[i]
		}
	}
	return nil
}

// newExecLog writes a log whose session holds one command.
func newExecLog(t testing.TB, argv []string, outs ...execOut) (string, uint64) {
	t.Helper()
	dir := t.TempDir()
	l, err := audit.Open(dir, audit.Options{Logger: quiet, CheckpointInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	w := &writer{t: t, l: l, ctx: context.Background()}
	w.append(audit.Record{Kind: audit.KindVMLifecycle, VM: testVM, Session: testSession, Data: w.data(map[string]any{"event": "started"})})
	seq := w.exec(argv, false, outs, 0)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return dir, seq
}

// castEvent is one parsed asciicast event.
type castEvent struct {
	T    float64
	Text string
}

// parseCast parses an asciicast v2 file strictly: the header, then
// [time, "o", text] lines with times that never go back.
func parseCast(t testing.TB, b []byte) (map[string]any, []castEvent) {
	t.Helper()
	lines := strings.Split(strings.TrimSuffix(string(b), "\n"), "\n")
	var hdr map[string]any
	if err := json.Unmarshal([]byte(lines[0]), &hdr); err != nil {
		t.Fatalf("header %q: %v", lines[0], err)
	}
	if hdr["version"] != float64(2) {
		t.Fatalf("header %v: not version 2", hdr)
	}
	for _, k := range []string{"width", "height", "timestamp"} {
		if _, ok := hdr[k].(float64); !ok {
			t.Fatalf("header %v: no %s", hdr, k)
		}
	}
	var evs []castEvent
	prev := 0.0
	for _, line := range lines[1:] {
		if !utf8.ValidString(line) {
			t.Fatalf("event %q is not UTF-8", line)
		}
		var raw []json.RawMessage
		if err := json.Unmarshal([]byte(line), &raw); err != nil || len(raw) != 3 {
			t.Fatalf("event %q: %v", line, err)
		}
		var ev castEvent
		var code string
		if json.Unmarshal(raw[0], &ev.T) != nil || json.Unmarshal(raw[1], &code) != nil || json.Unmarshal(raw[2], &ev.Text) != nil || code != "o" {
			t.Fatalf("event %q: want [time, \"o\", text]", line)
		}
		if ev.T < prev {
			t.Fatalf("event %q goes back in time from %f", line, prev)
		}
		prev = ev.T
		evs = append(evs, ev)
	}
	return hdr, evs
}
