package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/image/verity"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/witness"
)

const reviewSession = "ses_00000000000000aa"

// reviewLog writes a small log: a session that starts, is denied a
// command, runs one that prints, and stops.
func reviewLog(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	l, err := audit.Open(dir, audit.Options{Logger: slog.New(slog.DiscardHandler), CheckpointInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	add := func(kind, data string, blobs ...string) uint64 {
		seq, err := l.Append(ctx, audit.Record{Kind: kind, VM: "box", Session: reviewSession, Provenance: audit.Host, Blobs: blobs, Data: json.RawMessage(data)})
		if err != nil {
			t.Fatal(err)
		}
		return seq
	}
	add(audit.KindVMLifecycle, `{"event":"started","image_digest":"sha256:`+strings.Repeat("ab", 32)+`","policy":"strict","policy_revision":"r2"}`)
	add(audit.KindPolicyDecision, `{"id":"d1","kind":"exec","policy":"strict","revision":"r2","allow":false,"rule":"deny_curl","reason":"no network"}`)
	p, err := l.Begin(ctx, audit.Record{VM: "box", Session: reviewSession, Provenance: audit.Host, Data: json.RawMessage(`{"action":"exec","argv":["ls","-l"],"cwd":"/w","user":"agent"}`)})
	if err != nil {
		t.Fatal(err)
	}
	out := "total 0\n-rw-r--r-- 1 agent agent 0 a.txt\n"
	blob, err := l.PutBlob(strings.NewReader(out))
	if err != nil {
		t.Fatal(err)
	}
	add(audit.KindExecOutput, fmt.Sprintf(`{"exec":%d,"stream":"stdout","offset":0,"size":%d,"chunks":[[1000,8],[500000000,%d]]}`, p.Seq(), len(out), len(out)-8), blob)
	if _, err := p.End(ctx, audit.Record{Kind: audit.KindExecExit, Provenance: audit.Host, Data: json.RawMessage(fmt.Sprintf(`{"code":0,"stdout_bytes":%d,"stderr_bytes":0}`, len(out)))}); err != nil {
		t.Fatal(err)
	}
	add(audit.KindVMLifecycle, `{"event":"stopped"}`)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return dir
}

// carrel runs the CLI and returns its stdout, stderr and error.
func carrel(t *testing.T, args ...string) (string, string, error) {
	t.Helper()
	root := newRootCmd()
	var out, errOut bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&errOut)
	root.SetArgs(args)
	err := root.Execute()
	return out.String(), errOut.String(), err
}

func TestAuditShow(t *testing.T) {
	dir := reviewLog(t)
	out, _, err := carrel(t, "audit", "show", reviewSession, "--dir", dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"SEQ  KIND", "deny exec rule deny_curl reason: no network [policy strict@r2]", "exec $ ls -l (cwd /w, user agent)", "exit 0 stdout 41 B", " stopped"} {
		if !strings.Contains(out, want) {
			t.Errorf("show lacks %q:\n%s", want, out)
		}
	}

	out, _, err = carrel(t, "audit", "show", reviewSession, "--dir", dir, "--kind", "exec.*", "-o", "json")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 2 {
		t.Fatalf("json: %d lines:\n%s", len(lines), out)
	}
	for _, line := range lines {
		rec, err := audit.Decode([]byte(line))
		if err != nil || !strings.HasPrefix(rec.Kind, "exec.") || rec.Session != reviewSession {
			t.Errorf("json line %q: %+v, %v", line, rec, err)
		}
	}

	out, _, err = carrel(t, "audit", "show", "box", "--dir", dir, "--kind", "vm.lifecycle")
	if err != nil || strings.Count(out, reviewSession) != 2 || !strings.Contains(out, "SESSION") {
		t.Errorf("show vm: %v\n%s", err, out)
	}
	if _, _, err := carrel(t, "audit", "show", "ses_00000000000000bb", "--dir", dir); err == nil || !strings.Contains(err.Error(), "not in the audit log") {
		t.Errorf("unknown session: %v", err)
	}
	if _, _, err := carrel(t, "audit", "show", reviewSession, "--dir", dir, "--kind", "Bad Kind"); err == nil {
		t.Error("a bad --kind was accepted")
	}
}

func TestAuditReplay(t *testing.T) {
	dir := reviewLog(t)
	out, _, err := carrel(t, "audit", "replay", reviewSession, "--dir", dir, "--speed", "1000")
	if err != nil {
		t.Fatal(err)
	}
	if out != "$ ls -l\ntotal 0\n-rw-r--r-- 1 agent agent 0 a.txt\n" {
		t.Errorf("replay %q", out)
	}
	cast := filepath.Join(t.TempDir(), "s.cast")
	if _, _, err := carrel(t, "audit", "replay", reviewSession, "--dir", dir, "--cast", cast); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(cast)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	var hdr struct {
		Version int     `json:"version"`
		Idle    float64 `json:"idle_time_limit"`
	}
	if err := json.Unmarshal([]byte(lines[0]), &hdr); err != nil || hdr.Version != 2 || hdr.Idle != 2 || len(lines) != 4 {
		t.Errorf("cast %s", b)
	}
	var last []any
	if err := json.Unmarshal([]byte(lines[3]), &last); err != nil || last[0] != 0.5 || last[2] != "-rw-r--r-- 1 agent agent 0 a.txt\n" {
		t.Errorf("last event %s", lines[3])
	}
	if _, _, err := carrel(t, "audit", "replay", reviewSession, "--dir", dir, "--speed", "0"); err == nil {
		t.Error("--speed 0 accepted")
	}
}

func TestAuditExportVerifyReport(t *testing.T) {
	dir := reviewLog(t)
	key, err := audit.PublicKey(dir) // what carrel audit key prints
	if err != nil {
		t.Fatal(err)
	}
	bundle := filepath.Join(t.TempDir(), "b.tar")
	out, _, err := carrel(t, "audit", "export", reviewSession, "--dir", dir, "-o", bundle)
	if err != nil || !strings.Contains(out, "6 records, 1 blobs, proved against the checkpoint of 6 records") {
		t.Fatalf("export: %v\n%s", err, out)
	}

	out, _, err = carrel(t, "audit", "verify", "--bundle", bundle, "--key", key)
	if err != nil || !strings.Contains(out, "image sha256:abab") || !strings.Contains(out, "policy strict@r2") || !strings.Contains(out, "signature verified with the key given") || !strings.Contains(out, "ok:") {
		t.Errorf("verify: %v\n%s", err, out)
	}
	out, _, err = carrel(t, "audit", "verify", "--bundle", bundle, "-o", "json")
	var rep struct {
		KeyFromBundle bool            `json:"key_from_bundle"`
		Problems      []audit.Problem `json:"problems"`
	}
	if err != nil || json.Unmarshal([]byte(out), &rep) != nil || !rep.KeyFromBundle || len(rep.Problems) != 0 {
		t.Errorf("verify json: %v\n%s", err, out)
	}

	// A byte changed in a record in the tar: verify names the record and
	// exits 1.
	b, _ := os.ReadFile(bundle)
	i := bytes.Index(b, []byte("no network"))
	b[i] = 'N'
	bad := filepath.Join(t.TempDir(), "bad.tar")
	os.WriteFile(bad, b, 0o644)
	out, errOut, err := carrel(t, "audit", "verify", "--bundle", bad, "--key", key)
	var ee exitError
	if !errors.As(err, &ee) || ee.code != 1 || !strings.Contains(out, "proof at record 1: not in the checkpoint's tree") || !strings.Contains(errOut, "FAILED") {
		t.Errorf("tampered: %v\n%s%s", err, out, errOut)
	}
	if _, _, err := carrel(t, "audit", "verify", "--bundle", bundle, "--dir", dir); err == nil {
		t.Error("--bundle with --dir accepted")
	}
	// A bundle whose checkpoint no witness cosigned, held to a witness.
	_, wkey, err := witness.GenerateKey("w1.example")
	if err != nil {
		t.Fatal(err)
	}
	out, errOut, err = carrel(t, "audit", "verify", "--bundle", bundle, "--key", key, "--witness", wkey)
	if !errors.As(err, &ee) || ee.code != 1 || !strings.Contains(out, "cosigned by 0 of the 1 witnesses given (1 needed): none") ||
		!strings.Contains(out, "unwitnessed at checkpoint 6: the checkpoint at 6 records") || !strings.Contains(out, "missing: witness w1.example") {
		t.Errorf("unwitnessed: %v\n%s%s", err, out, errOut)
	}
	if _, _, err := carrel(t, "audit", "verify", "--bundle", bundle, "--witness", wkey, "--quorum", "2"); err == nil || !strings.Contains(err.Error(), "only 1 witnesses") {
		t.Errorf("--quorum 2 of 1 witness: %v", err)
	}
	if _, _, err := carrel(t, "audit", "export", reviewSession, "--dir", dir); err == nil {
		t.Error("export without -o accepted")
	}

	page := filepath.Join(t.TempDir(), "r.html")
	if _, _, err := carrel(t, "audit", "report", reviewSession, "--dir", dir, "-o", page, "--key", key); err != nil {
		t.Fatal(err)
	}
	html, _ := os.ReadFile(page)
	for _, want := range []string{"Integrity checked", "deny_curl", "$ ls -l", "a.txt", "AsciinemaPlayer.create"} {
		if !bytes.Contains(html, []byte(want)) {
			t.Errorf("report lacks %q", want)
		}
	}
}

const imageSession = "ses_00000000000000cc"

// imageLog writes a log whose session's starting record names its image
// and keeps the image's manifest as a blob, as carreld does, and returns
// it with the manifest's digest and the blob's path.
func imageLog(t *testing.T) (dir, digest, blobPath string) {
	t.Helper()
	root := strings.Repeat("c4", 32)
	v := &manifest.Verity{Mount: manifest.MountRoot, RootHash: root, HashAlg: "sha256", DataBlockSize: 4096, HashBlockSize: 4096,
		DataBlocks: 16, UUID: "6361726c-0000-8000-8000-000000000002"}
	p, _, err := v.Params()
	if err != nil {
		t.Fatal(err)
	}
	m := &manifest.Manifest{SchemaVersion: manifest.SchemaVersion, Name: "agent", Arch: "amd64", KernelVersion: "6.1.0-28-amd64",
		Kernel:       manifest.Part{Digest: manifest.DigestBytes([]byte("k")), Size: 1},
		Initrd:       manifest.Part{Digest: manifest.DigestBytes([]byte("i")), Size: 1},
		Cmdline:      "console=ttyS0 roothash=" + root,
		System:       &manifest.Part{Digest: manifest.DigestBytes([]byte("s")), Size: 16 * 4096},
		SystemVerity: &manifest.Part{Digest: manifest.DigestBytes([]byte("h")), Size: verity.HashSize(p)},
		Verity:       v,
		Packages:     []manifest.Package{{Name: "bash", Version: "5.2.15-2+b7", Arch: "amd64"}, {Name: "nix-hello", Version: "2.12.1"}},
	}
	b, err := m.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	dir = t.TempDir()
	l, err := audit.Open(dir, audit.Options{Logger: slog.New(slog.DiscardHandler), CheckpointInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	digest, err = l.PutBlob(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	for _, rec := range []audit.Record{
		{Kind: audit.KindVMLifecycle, Blobs: []string{digest}, Data: json.RawMessage(`{"event":"starting","image_digest":"` + digest + `","image_name":"agent","root_hash":"` + root + `","policy":"strict"}`)},
		{Kind: audit.KindVMLifecycle, Data: json.RawMessage(`{"event":"stopped"}`)},
	} {
		rec.VM, rec.Session, rec.Provenance = "box", imageSession, audit.Host
		if _, err := l.Append(ctx, rec); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	blobPath, _ = audit.BlobPath(dir, digest)
	return dir, digest, blobPath
}

func TestAuditImage(t *testing.T) {
	dir, digest, blob := imageLog(t)
	out, _, err := carrel(t, "audit", "show", imageSession, "--dir", dir)
	if err != nil || !strings.Contains(out, "starting, image agent "+digest[:19]+"…, root hash c4c4c4c4c4c4…, policy strict") {
		t.Errorf("show: %v\n%s", err, out)
	}
	out, _, err = carrel(t, "audit", "show", imageSession, "--dir", dir, "--packages")
	want := "NAME       VERSION      ARCH\nbash       5.2.15-2+b7  amd64\nnix-hello  2.12.1       -\n"
	if err != nil || out != want {
		t.Errorf("show --packages: %v\n%s", err, out)
	}
	out, _, err = carrel(t, "audit", "show", imageSession, "--dir", dir, "--packages", "-o", "json")
	var img struct {
		RootHash string `json:"root_hash"`
		Packages []struct{ Name, Version, Arch string }
	}
	if err != nil || json.Unmarshal([]byte(out), &img) != nil || len(img.Packages) != 2 || img.Packages[1].Name != "nix-hello" || img.RootHash != strings.Repeat("c4", 32) {
		t.Errorf("show --packages -o json: %v\n%s", err, out)
	}
	if _, _, err := carrel(t, "audit", "show", "box", "--dir", dir, "--packages"); err == nil {
		t.Error("--packages of a VM accepted")
	}

	// From the bundle alone.
	bundle := filepath.Join(t.TempDir(), "b.tar")
	if _, _, err := carrel(t, "audit", "export", imageSession, "--dir", dir, "-o", bundle); err != nil {
		t.Fatal(err)
	}
	out, _, err = carrel(t, "audit", "verify", "--bundle", bundle, "--packages")
	for _, w := range []string{"image agent " + digest + ", root hash " + strings.Repeat("c4", 32) + ", policy strict\n",
		"image manifest: kernel 6.1.0-28-amd64, amd64, 2 packages\n", "bash       5.2.15-2+b7  amd64\n", "ok:"} {
		if err != nil || !strings.Contains(out, w) {
			t.Errorf("verify --bundle --packages lacks %q: %v\n%s", w, err, out)
		}
	}
	if _, _, err := carrel(t, "audit", "verify", "--dir", dir, "--packages"); err == nil {
		t.Error("--packages without --bundle accepted")
	}

	// A manifest gone from the log: show says why, the report still works.
	os.Remove(blob)
	_, _, err = carrel(t, "audit", "show", imageSession, "--dir", dir, "--packages")
	if err == nil || !strings.Contains(err.Error(), "is missing") {
		t.Errorf("show --packages without the manifest: %v", err)
	}
	page := filepath.Join(t.TempDir(), "r.html")
	if _, _, err := carrel(t, "audit", "report", imageSession, "--dir", dir, "-o", page); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(page); !bytes.Contains(b, []byte("is missing, so its packages are not known here")) {
		t.Error("the report does not say the manifest is missing")
	}
}
