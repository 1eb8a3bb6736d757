package review

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"

	"github.com/carrel-os/carrel/supervisor/audit"
)

var created = time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC)

func exportSample(t *testing.T, s *sampleLog) ([]byte, *Manifest) {
	t.Helper()
	r, sess := loadSample(t, s)
	var buf bytes.Buffer
	m, err := Export(&buf, r, sess, ExportOptions{Now: func() time.Time { return created }})
	if err != nil {
		t.Fatal(err)
	}
	return buf.Bytes(), m
}

func logKey(t *testing.T, dir string) string {
	t.Helper()
	k, err := audit.PublicKey(dir)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func verifyBundle(t *testing.T, b []byte, key string) *BundleReport {
	t.Helper()
	rep, err := VerifyBundle(bytes.NewReader(b), BundleVerifyOptions{Key: key})
	if err != nil {
		t.Fatalf("verify bundle: %v", err)
	}
	return rep
}

func TestExportVerify(t *testing.T) {
	s := newSampleLog(t)
	b, m := exportSample(t, s)
	_, sess := loadSample(t, s)
	key := logKey(t, s.dir)

	if m.Session != testSession || m.VM != testVM || m.ImageDigest != testImage || m.Policy != "default" || m.PolicyRevision != "rev-7" {
		t.Errorf("manifest %+v", m)
	}
	if m.Records != len(sess.Entries) || m.Unsigned != 0 || m.TreeSize != s.lateLoose+1 || !m.Created.Equal(created) || m.Key != key {
		t.Errorf("manifest %+v", m)
	}
	if len(m.Blobs) != 5 || len(m.Policies) != 1 { // 4 of output and content, and the image's manifest
		t.Errorf("blobs %v, policies %v", m.Blobs, m.Policies)
	}

	// The bundle holds each record's payload byte for byte.
	files := untar(t, b)
	for _, e := range sess.Entries {
		got, ok := files.get(fmt.Sprintf("records/%020d.json", e.Seq))
		if !ok || !bytes.Equal(got, e.Payload) {
			t.Errorf("record %d: %q, want %q", e.Seq, got, e.Payload)
		}
	}
	if _, ok := files.get("blobs/sha256/" + strings.TrimPrefix(s.writeBlob, "sha256:")); !ok {
		t.Error("the written file's blob is not in the bundle")
	}

	rep := verifyBundle(t, b, key)
	if !rep.OK() || rep.KeyFromBundle || !rep.CheckpointVerified || rep.Records != m.Records || rep.Blobs != 5 || rep.TreeSize != m.TreeSize {
		t.Errorf("report %+v", rep)
	}
	rep = verifyBundle(t, b, "")
	if !rep.OK() || !rep.KeyFromBundle || len(rep.Notes) == 0 {
		t.Errorf("without a key: %+v", rep)
	}
	// Unpacked and packed again (with directories and ./ names), it still
	// verifies.
	var re bytes.Buffer
	tw := tar.NewWriter(&re)
	tw.WriteHeader(&tar.Header{Name: "./records/", Typeflag: tar.TypeDir, Mode: 0o755})
	for _, f := range files {
		tw.WriteHeader(&tar.Header{Name: "./" + f.name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(f.data))})
		tw.Write(f.data)
	}
	tw.Close()
	if rep := verifyBundle(t, re.Bytes(), key); !rep.OK() {
		t.Errorf("repacked: %v", rep.Problems)
	}
}

type tarFile struct {
	name string
	data []byte
}

type tarFiles []tarFile

func untar(t *testing.T, b []byte) tarFiles {
	t.Helper()
	var fs tarFiles
	tr := tar.NewReader(bytes.NewReader(b))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return fs
		}
		if err != nil {
			t.Fatal(err)
		}
		data, _ := io.ReadAll(tr)
		fs = append(fs, tarFile{h.Name, data})
	}
}

func (fs tarFiles) get(name string) ([]byte, bool) {
	for _, f := range fs {
		if f.name == name {
			return f.data, true
		}
	}
	return nil, false
}

func (fs tarFiles) set(name string, data []byte) tarFiles {
	for i := range fs {
		if fs[i].name == name {
			fs[i].data = data
			return fs
		}
	}
	return append(fs, tarFile{name, data})
}

func (fs tarFiles) drop(name string) tarFiles {
	var out tarFiles
	for _, f := range fs {
		if f.name != name {
			out = append(out, f)
		}
	}
	return out
}

func (fs tarFiles) tar(t *testing.T) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, f := range fs {
		if err := tw.WriteHeader(&tar.Header{Name: f.name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(f.data))}); err != nil {
			t.Fatal(err)
		}
		tw.Write(f.data)
	}
	tw.Close()
	return buf.Bytes()
}

func (fs tarFiles) manifest(t *testing.T, edit func(*Manifest)) tarFiles {
	t.Helper()
	b, _ := fs.get("manifest.json")
	var m Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	edit(&m)
	nb, _ := json.Marshal(&m)
	return fs.set("manifest.json", nb)
}

func recName(seq uint64) string { return fmt.Sprintf("records/%020d", seq) }

// expect checks that the report has a problem of each kind wanted, at
// the seq wanted (or at none, for -1), and no problem of another kind.
func expect(t *testing.T, rep *BundleReport, wants ...problemWant) {
	t.Helper()
	if rep.OK() {
		t.Fatalf("the bundle verified; want %v", wants)
	}
	for _, w := range wants {
		found := false
		for _, p := range rep.Problems {
			if p.Kind == w.kind && (w.seq < 0 && p.Seq == nil || p.Seq != nil && int64(*p.Seq) == w.seq) && strings.Contains(p.Detail, w.detail) {
				found = true
			}
		}
		if !found {
			t.Errorf("no %s problem at %d with %q; got:", w.kind, w.seq, w.detail)
			for _, p := range rep.Problems {
				t.Errorf("  %v", p)
			}
		}
	}
	kinds := map[audit.ProblemKind]bool{}
	for _, w := range wants {
		kinds[w.kind] = true
	}
	for _, p := range rep.Problems {
		if !kinds[p.Kind] {
			t.Errorf("unexpected problem %v", p)
		}
	}
}

type problemWant struct {
	kind   audit.ProblemKind
	seq    int64
	detail string
}

func TestBundleTamper(t *testing.T) {
	s := newSampleLog(t)
	b, m := exportSample(t, s)
	key := logKey(t, s.dir)
	blob := strings.TrimPrefix(s.writeBlob, "sha256:")

	for _, tc := range []struct {
		name  string
		edit  func(tarFiles) tarFiles
		wants []problemWant
	}{
		{"flipped byte in a record", func(fs tarFiles) tarFiles {
			p, _ := fs.get(recName(s.denySeq) + ".json")
			p = bytes.Clone(p)
			p[bytes.Index(p, []byte("no egress"))] ^= 0x20 // "No egress": still a record
			return fs.set(recName(s.denySeq)+".json", p)
		}, []problemWant{{ProblemProof, int64(s.denySeq), "not in the checkpoint's tree"}}},

		{"record moved to another seq", func(fs tarFiles) tarFiles {
			p, _ := fs.get(recName(s.denySeq) + ".json")
			pr, _ := fs.get(recName(s.denySeq) + ".proof")
			fs = fs.drop(recName(s.denySeq) + ".json").drop(recName(s.denySeq) + ".proof")
			return fs.set(recName(s.otherSeq)+".json", p).set(recName(s.otherSeq)+".proof", pr)
		}, []problemWant{
			{ProblemProof, int64(s.otherSeq), ""},
			{audit.ProblemRecord, int64(s.otherSeq), fmt.Sprintf("named for record %d, the record says %d", s.otherSeq, s.denySeq)},
			{ProblemManifest, int64(s.denySeq), "a record was removed"},
			{ProblemManifest, int64(s.otherSeq), "a record was added"},
		}},

		{"dropped record", func(fs tarFiles) tarFiles {
			return fs.drop(recName(s.denySeq) + ".json").drop(recName(s.denySeq) + ".proof")
		}, []problemWant{
			{ProblemManifest, int64(s.denySeq), "listed in the manifest but not in the bundle"},
			{ProblemManifest, -1, fmt.Sprintf("records: the manifest says %d, the bundle holds %d", m.Records, m.Records-1)},
		}},

		{"dropped record, proof left behind", func(fs tarFiles) tarFiles {
			return fs.drop(recName(s.denySeq) + ".json")
		}, []problemWant{
			{ProblemBundle, int64(s.denySeq), "an inclusion proof without its record"},
			{ProblemManifest, int64(s.denySeq), "listed in the manifest but not in the bundle"},
			{ProblemManifest, -1, "records:"},
		}},

		{"dropped intent, manifest made to match", func(fs tarFiles) tarFiles {
			fs = fs.drop(recName(s.script) + ".json").drop(recName(s.script) + ".proof")
			return fs.manifest(t, func(m *Manifest) {
				m.Records--
				for i, q := range m.Seqs {
					if q == s.script {
						m.Seqs = append(m.Seqs[:i], m.Seqs[i+1:]...)
						break
					}
				}
			})
		}, []problemWant{
			{audit.ProblemIntent, int64(s.script + 1), fmt.Sprintf("output of exec %d, whose intent is not in the bundle", s.script)},
			{audit.ProblemIntent, int64(s.script + 3), fmt.Sprintf("outcome of intent %d, which is not in the bundle", s.script)},
		}},

		{"replaced blob", func(fs tarFiles) tarFiles {
			return fs.set("blobs/sha256/"+blob, []byte("HELLO"))
		}, []problemWant{{audit.ProblemBlobMismatch, int64(s.fileOpSeq), "it was replaced"}}},

		{"missing blob", func(fs tarFiles) tarFiles {
			return fs.drop("blobs/sha256/" + blob)
		}, []problemWant{{audit.ProblemBlobMissing, int64(s.fileOpSeq), "not in the bundle"}}},

		{"extra file", func(fs tarFiles) tarFiles {
			return fs.set("records/evil.sh", []byte("#!/bin/sh")).set("blobs/sha256/"+strings.Repeat("0", 64), []byte("x"))
		}, []problemWant{{ProblemBundle, -1, `"records/evil.sh": not a name a bundle holds`}, {ProblemBundle, -1, "a blob no record in the bundle references"}}},

		{"manifest lies about the image and policy", func(fs tarFiles) tarFiles {
			return fs.manifest(t, func(m *Manifest) {
				m.ImageDigest = "sha256:" + strings.Repeat("9", 64)
				m.PolicyRevision = "rev-1"
				m.VM = "someone-else"
			})
		}, []problemWant{
			{ProblemManifest, -1, "image_digest"},
			{ProblemManifest, -1, "policy_revision"},
			{ProblemManifest, int64(s.echo), `the record is vm "demo"'s`},
		}},

		{"checkpoint text forged", func(fs tarFiles) tarFiles {
			// Another root, signature kept.
			cp, _ := fs.get("checkpoint")
			lines := strings.SplitN(string(cp), "\n", 4)
			forged := strings.Join([]string{lines[0], lines[1], tlog.Hash{1}.String(), lines[3]}, "\n")
			return fs.set("checkpoint", []byte(forged))
		}, []problemWant{
			{audit.ProblemCheckpointSignature, -1, "does not verify"},
			{ProblemProof, int64(s.echo), ""},
			{ProblemManifest, -1, "tree"},
		}},

		{"checkpoint gone", func(fs tarFiles) tarFiles { return fs.drop("checkpoint") },
			[]problemWant{{ProblemBundle, -1, "no checkpoint"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs := untar(t, b)
			rep := verifyBundle(t, tc.edit(fs).tar(t), key)
			expect(t, rep, tc.wants...)
		})
	}
}

// TestBundleForgedKey: a forger who signs a checkpoint of their own, and
// puts their key in the bundle, passes only a check against the bundle's
// own key.
func TestBundleForgedKey(t *testing.T) {
	s := newSampleLog(t)
	b, m := exportSample(t, s)
	key := logKey(t, s.dir)

	skey, vkey, err := note.GenerateKey(rand.Reader, audit.KeyName)
	if err != nil {
		t.Fatal(err)
	}
	signer, _ := note.NewSigner(skey)
	fs := untar(t, b)
	// Change a record, and sign the tree with it changed.
	p, _ := fs.get(recName(s.denySeq) + ".json")
	p = bytes.Replace(p, []byte(`"allow":false`), []byte(`"allow":true `), 1)
	fs = fs.set(recName(s.denySeq)+".json", p)
	// The forger recomputes a tree in which their records are the leaves:
	// here, the tree of the bundle's records alone, each proved in it.
	root, proofs := forgeTree(t, fs, m.TreeSize)
	for seq, pr := range proofs {
		fs = fs.set(recName(seq)+".proof", formatProof(pr))
	}
	msg, err := note.Sign(&note.Note{Text: fmt.Sprintf("%s\n%d\n%s\n", audit.KeyName, m.TreeSize, root)}, signer)
	if err != nil {
		t.Fatal(err)
	}
	fs = fs.set("checkpoint", msg).set("key.pub", []byte(vkey+"\n"))
	fs = fs.manifest(t, func(m *Manifest) { m.Root, m.Key = root.String(), vkey })
	forged := fs.tar(t)

	if rep := verifyBundle(t, forged, ""); !rep.OK() || !rep.KeyFromBundle {
		t.Errorf("checked with its own key, a consistent forgery passes (that is why --key matters); got %v", rep.Problems)
	}
	// With the log's key, the signature fails. (The records are then
	// checked against the checkpoint's unverified text, which the forger
	// made consistent with them.)
	rep := verifyBundle(t, forged, key)
	expect(t, rep, problemWant{audit.ProblemCheckpointSignature, -1, "does not verify"})
	if rep.CheckpointVerified || len(rep.Notes) < 2 {
		t.Errorf("report %+v", rep)
	}
}

// forgeTree builds a tree of size n whose leaves at the bundle's record
// seqs are its records, and proves each in it.
func forgeTree(t *testing.T, fs tarFiles, n uint64) (tlog.Hash, map[uint64]tlog.RecordProof) {
	t.Helper()
	var stored []tlog.Hash
	r := tlog.HashReaderFunc(func(idx []int64) ([]tlog.Hash, error) {
		out := make([]tlog.Hash, len(idx))
		for i, x := range idx {
			out[i] = stored[x]
		}
		return out, nil
	})
	inBundle := map[uint64]bool{}
	for i := uint64(0); i < n; i++ {
		leaf := tlog.RecordHash([]byte("filler"))
		if p, ok := fs.get(recName(i) + ".json"); ok {
			leaf, inBundle[i] = tlog.RecordHash(p), true
		}
		hs, err := tlog.StoredHashesForRecordHash(int64(i), leaf, r)
		if err != nil {
			t.Fatal(err)
		}
		stored = append(stored, hs...)
	}
	root, err := tlog.TreeHash(int64(n), r)
	if err != nil {
		t.Fatal(err)
	}
	proofs := map[uint64]tlog.RecordProof{}
	for seq := range inBundle {
		if proofs[seq], err = tlog.ProveRecord(int64(n), int64(seq), r); err != nil {
			t.Fatal(err)
		}
	}
	return root, proofs
}

// TestExportLiveLog exports from a log carreld still has open: records
// after its latest checkpoint are left out, and counted.
func TestExportLiveLog(t *testing.T) {
	s := newSampleLog(t)
	l, err := audit.Open(s.dir, audit.Options{Logger: quiet, CheckpointInterval: time.Hour, CheckpointEvery: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	w := &writer{t: t, l: l, ctx: context.Background()}
	late := w.exec([]string{"true"}, false, []execOut{{"stdout", []byte("late\n"), []int{5}, []int64{1}}}, 0)

	r, sess := loadSample(t, s)
	if sess.entry(late) == nil {
		t.Fatal("the new command is not in the session")
	}
	var buf bytes.Buffer
	m, err := Export(&buf, r, sess, ExportOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if m.Unsigned != 3 || m.Records != len(sess.Entries)-3 || m.TreeSize != late {
		t.Errorf("manifest: %d records, %d unsigned, tree %d (late command at %d)", m.Records, m.Unsigned, m.TreeSize, late)
	}
	if _, ok := untar(t, buf.Bytes()).get(recName(late) + ".json"); ok {
		t.Error("an unsigned record is in the bundle")
	}
	if rep := verifyBundle(t, buf.Bytes(), logKey(t, s.dir)); !rep.OK() {
		t.Errorf("%v", rep.Problems)
	}
}

func TestExportRefusesDamage(t *testing.T) {
	t.Run("replaced blob", func(t *testing.T) {
		s := newSampleLog(t)
		path, _ := audit.BlobPath(s.dir, s.writeBlob)
		os.Chmod(path, 0o600)
		if err := os.WriteFile(path, []byte("HELLO"), 0o600); err != nil {
			t.Fatal(err)
		}
		r, sess := loadSample(t, s)
		_, err := Export(io.Discard, r, sess, ExportOptions{})
		if err == nil || !strings.Contains(err.Error(), "it was replaced") {
			t.Errorf("export: %v", err)
		}
	})
	t.Run("changed record, CRC resealed", func(t *testing.T) {
		s := newSampleLog(t)
		path := filepath.Join(s.dir, "records.log")
		b, _ := os.ReadFile(path)
		r, sess := loadSample(t, s)
		e := sess.entry(s.denySeq)
		at := e.Offset + 8 + int64(bytes.Index(e.Payload, []byte("no egress")))
		b[at] = 'N'
		n := binary.LittleEndian.Uint32(b[e.Offset:])
		binary.LittleEndian.PutUint32(b[e.Offset+4:], crc32.Checksum(b[e.Offset+8:e.Offset+8+int64(n)], crc32.MakeTable(crc32.Castagnoli)))
		os.WriteFile(path, b, 0o600)
		sess, err := LoadSession(r, testSession)
		if err != nil {
			t.Fatal(err)
		}
		_, err = Export(io.Discard, r, sess, ExportOptions{})
		if !errors.Is(err, audit.ErrCheckpointMismatch) {
			t.Errorf("export: %v", err)
		}
	})
	t.Run("no checkpoint", func(t *testing.T) {
		s := newSampleLog(t)
		os.RemoveAll(filepath.Join(s.dir, "checkpoints"))
		r, sess := loadSample(t, s)
		if _, err := Export(io.Discard, r, sess, ExportOptions{}); !errors.Is(err, ErrNoCheckpoint) {
			t.Errorf("export: %v", err)
		}
	})
	t.Run("wrong key", func(t *testing.T) {
		s := newSampleLog(t)
		_, vkey, _ := note.GenerateKey(rand.Reader, audit.KeyName)
		r, sess := loadSample(t, s)
		if _, err := Export(io.Discard, r, sess, ExportOptions{Key: vkey}); !errors.Is(err, audit.ErrCheckpointMismatch) {
			t.Errorf("export: %v", err)
		}
	})
}

func TestVerifyBundleNotATar(t *testing.T) {
	if _, err := VerifyBundle(strings.NewReader(strings.Repeat("not a tar file ", 100)), BundleVerifyOptions{}); err == nil {
		t.Error("garbage verified")
	}
	rep, err := VerifyBundle(bytes.NewReader(tarFiles{}.tar(t)), BundleVerifyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	expect(t, rep, problemWant{ProblemBundle, -1, "no key.pub"}, problemWant{ProblemBundle, -1, "no checkpoint"},
		problemWant{ProblemBundle, -1, "no manifest.json"})
}

// TestBundleSignedManifest: a bundle exported with the log's key carries
// its manifest's signature; the manifest changed after, or signed by
// another key, is a problem; a bundle without one says so.
func TestBundleSignedManifest(t *testing.T) {
	s := newSampleLog(t)
	r, sess := loadSample(t, s)
	signer, err := audit.Signer(s.dir)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if _, err := Export(&buf, r, sess, ExportOptions{Now: func() time.Time { return created }, Signer: signer}); err != nil {
		t.Fatal(err)
	}
	key := logKey(t, s.dir)
	rep := verifyBundle(t, buf.Bytes(), key)
	if !rep.OK() || !rep.ManifestSigned {
		t.Fatalf("a signed bundle: %+v", rep)
	}
	fs := untar(t, buf.Bytes())
	mb, _ := fs.get(bundleManifest)
	changed := bytes.Replace(mb, []byte(`"vm": "`), []byte(`"vm": "x`), 1)
	rep = verifyBundle(t, fs.set(bundleManifest, changed).tar(t), key)
	if rep.ManifestSigned || !hasProblem(rep, ProblemManifest, "was changed") {
		t.Errorf("a changed manifest: %+v", rep.Problems)
	}
	// Signed by another key (a forger's): it does not verify with the log's.
	otherSkey, _, err := note.GenerateKey(rand.Reader, audit.KeyName)
	if err != nil {
		t.Fatal(err)
	}
	other, _ := note.NewSigner(otherSkey)
	forged, _ := note.Sign(&note.Note{Text: manifestSigText(changed)}, other)
	rep = verifyBundle(t, fs.set(bundleManifest, changed).set(bundleManifestSig, forged).tar(t), key)
	if rep.ManifestSigned || !hasProblem(rep, ProblemManifest, "does not verify with the key") {
		t.Errorf("a manifest signed by another key: %+v", rep.Problems)
	}
	unsigned, _ := exportSample(t, s)
	rep = verifyBundle(t, unsigned, key)
	if rep.ManifestSigned || !slicesContainsPrefix(rep.Notes, "the manifest is not signed") {
		t.Errorf("an unsigned bundle: signed %v, notes %q", rep.ManifestSigned, rep.Notes)
	}
}

func hasProblem(rep *BundleReport, kind audit.ProblemKind, detail string) bool {
	for _, p := range rep.Problems {
		if p.Kind == kind && strings.Contains(p.Detail, detail) {
			return true
		}
	}
	return false
}

func slicesContainsPrefix(ss []string, prefix string) bool {
	for _, s := range ss {
		if strings.HasPrefix(s, prefix) {
			return true
		}
	}
	return false
}
