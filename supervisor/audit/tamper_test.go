package audit

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"hash/crc32"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"
)

// tamperLog is a closed log of 50 records with checkpoints every 10, and
// a blob referenced by record 7.
func tamperLog(t *testing.T) (dir, blob string) {
	dir = t.TempDir()
	l := openLog(t, dir, Options{CheckpointEvery: 10})
	appendN(t, l, 7)
	blob, err := l.PutBlob(strings.NewReader("stdout bytes\n"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.Append(context.Background(), Record{Kind: KindExecOutput, Provenance: Guest, Blobs: []string{blob}}); err != nil {
		t.Fatal(err)
	}
	appendN(t, l, 42)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	mustVerify(t, dir)
	return dir, blob
}

func copyDir(t *testing.T, src string) string {
	dst := t.TempDir()
	if err := os.CopyFS(dst, os.DirFS(src)); err != nil {
		t.Fatal(err)
	}
	return dst
}

// want is a problem a tampered log must show: its kind and position.
type want struct {
	kind       ProblemKind
	seq        int64 // -1: any
	offset     int64 // -1: any
	checkpoint int64 // -1: any
	blob       string
}

func (w want) matches(p Problem) bool {
	return p.Kind == w.kind &&
		(w.seq < 0 || p.Seq != nil && int64(*p.Seq) == w.seq) &&
		(w.offset < 0 || p.Offset != nil && *p.Offset == w.offset) &&
		(w.checkpoint < 0 || p.Checkpoint != nil && int64(*p.Checkpoint) == w.checkpoint) &&
		(w.blob == "" || p.Blob == w.blob)
}

func expectProblems(t *testing.T, dir string, opts VerifyOptions, wants ...want) *Report {
	t.Helper()
	rep, err := Verify(dir, opts)
	if err != nil {
		t.Fatalf("verify: %v", err)
	}
	if rep.OK() {
		t.Fatal("verify found nothing")
	}
	for _, w := range wants {
		found := false
		for _, p := range rep.Problems {
			found = found || w.matches(p)
		}
		if !found {
			t.Errorf("no %s problem at record %d offset %d checkpoint %d %s; got:", w.kind, w.seq, w.offset, w.checkpoint, w.blob)
			for _, p := range rep.Problems {
				t.Errorf("  %v", p)
			}
		}
	}
	return rep
}

func resealFrame(b []byte, off int64) {
	n := binary.LittleEndian.Uint32(b[off:])
	binary.LittleEndian.PutUint32(b[off+4:], crc32.Checksum(b[off+8:off+8+int64(n)], castagnoli()))
}

func TestTamperFlippedByte(t *testing.T) {
	src, _ := tamperLog(t)
	offs, _ := frames(t, src)
	r := offs[25]
	for name, tc := range map[string]struct {
		at     int64
		reseal bool // the forger fixes the CRC too
		wants  []want
	}{
		"payload": {r + 8 + 40, false, []want{
			{ProblemCRC, 25, r, -1, ""}, {ProblemCheckpointRoot, -1, -1, 30, ""}, {ProblemCheckpointRoot, -1, -1, 50, ""}}},
		"payload, CRC resealed": {r + 8 + 40, true, []want{{ProblemCheckpointRoot, -1, -1, 30, ""}}},
		"seq digit, CRC resealed": {r + 8 + int64(len(`{"seq":`)), true, []want{
			{ProblemSeq, 25, r, -1, ""}, {ProblemCheckpointRoot, -1, -1, 30, ""}}},
		"crc field": {r + 5, false, []want{{ProblemCRC, 25, r, -1, ""}}}, // the record itself is intact
		"length field": {r + 1, false, []want{
			{ProblemFrame, 25, r, -1, ""}, {ProblemCheckpointRoot, -1, -1, 30, ""}}},
		"first record": {offs[0] + 8 + 2, false, []want{{ProblemCRC, 0, 0, -1, ""}, {ProblemCheckpointRoot, -1, -1, 10, ""}}},
	} {
		t.Run(name, func(t *testing.T) {
			dir := copyDir(t, src)
			path := filepath.Join(dir, recordsFile)
			b := readFile(t, path)
			b[tc.at] ^= 0x04
			if tc.reseal {
				resealFrame(b, r)
			}
			writeFile(t, path, b)
			rep := expectProblems(t, dir, VerifyOptions{}, tc.wants...)
			for _, p := range rep.Problems {
				if p.Kind == ProblemCheckpointRoot && *p.Checkpoint < 30 && tc.at > offs[10] {
					t.Errorf("checkpoint before the change reported: %v", p)
				}
			}
			// Open refuses a log whose frames are damaged in mid-log
			// rather than cut it. (A resealed record under a checkpoint
			// is Verify's to find: Open hashes only what follows the
			// latest checkpoint.)
			if _, err := Open(dir, Options{Logger: quiet}); !tc.reseal && !errorsIs(err, ErrCorrupt) {
				t.Errorf("Open: %v", err)
			}
		})
	}
}

func TestTamperDeletedRecord(t *testing.T) {
	dir, _ := tamperLog(t)
	offs, _ := frames(t, dir)
	path := filepath.Join(dir, recordsFile)
	b := readFile(t, path)
	writeFile(t, path, append(b[:offs[25]:offs[25]], b[offs[26]:]...))
	expectProblems(t, dir, VerifyOptions{},
		want{ProblemSeq, 25, offs[25], -1, ""},
		want{ProblemCheckpointRoot, -1, -1, 30, ""},
		want{ProblemTruncated, -1, -1, 50, ""})
}

func TestTamperReorderedRecords(t *testing.T) {
	dir, _ := tamperLog(t)
	offs, _ := frames(t, dir)
	path := filepath.Join(dir, recordsFile)
	b := readFile(t, path)
	a, c := b[offs[25]:offs[26]], b[offs[26]:offs[27]]
	var out []byte
	out = append(out, b[:offs[25]]...)
	out = append(out, c...)
	out = append(out, a...)
	out = append(out, b[offs[27]:]...)
	writeFile(t, path, out)
	expectProblems(t, dir, VerifyOptions{},
		want{ProblemSeq, 25, offs[25], -1, ""},
		want{ProblemSeq, 26, -1, -1, ""},
		want{ProblemCheckpointRoot, -1, -1, 30, ""})
}

func TestTamperTruncation(t *testing.T) {
	src, _ := tamperLog(t)
	offs, _ := frames(t, src)

	dir := copyDir(t, src)
	if err := os.Truncate(filepath.Join(dir, recordsFile), offs[45]); err != nil {
		t.Fatal(err)
	}
	expectProblems(t, dir, VerifyOptions{}, want{ProblemTruncated, -1, -1, 50, ""})
	_, err := Open(dir, Options{Logger: quiet})
	var lost *LostError
	if !errorsAs(err, &lost) || lost.Checkpoint != 50 || lost.Records != 45 {
		t.Errorf("Open: %v", err)
	}

	// The forger also removes the checkpoints past the cut; the reviewer
	// holds one they kept.
	dir = copyDir(t, src)
	kept := readFile(t, filepath.Join(dir, checkpointDir, checkpointName(50)))
	os.Truncate(filepath.Join(dir, recordsFile), offs[45])
	os.Remove(filepath.Join(dir, checkpointDir, checkpointName(50)))
	if rep, err := Verify(dir, VerifyOptions{}); err != nil || !rep.OK() {
		t.Fatalf("without the kept checkpoint the cut is invisible, as expected: %v %v", rep.Problems, err)
	}
	expectProblems(t, dir, VerifyOptions{Checkpoints: [][]byte{kept}}, want{ProblemTruncated, -1, -1, 50, ""})
}

func TestTamperReplacedBlob(t *testing.T) {
	dir, blob := tamperLog(t)
	path := blobPath(dir, blob)
	os.Chmod(path, 0o600)
	writeFile(t, path, []byte("other bytes\n"))
	expectProblems(t, dir, VerifyOptions{}, want{ProblemBlobMismatch, 7, -1, -1, blob})
	os.Remove(path)
	expectProblems(t, dir, VerifyOptions{}, want{ProblemBlobMissing, 7, -1, -1, blob})
}

func TestTamperForgedCheckpoint(t *testing.T) {
	src, _ := tamperLog(t)
	pub, _ := PublicKey(src)
	path := func(dir string) string { return filepath.Join(dir, checkpointDir, checkpointName(30)) }
	otherKey, _, err := note.GenerateKey(rand.Reader, KeyName)
	if err != nil {
		t.Fatal(err)
	}
	ownKey := strings.TrimSpace(string(readFile(t, filepath.Join(src, keyFile))))
	sign := func(skey, text string) []byte {
		s, err := note.NewSigner(skey)
		if err != nil {
			t.Fatal(err)
		}
		msg, err := note.Sign(&note.Note{Text: text}, s)
		if err != nil {
			t.Fatal(err)
		}
		return msg
	}
	cp, err := ParseCheckpoint(readFile(t, path(src)), pub)
	if err != nil {
		t.Fatal(err)
	}
	var wrong tlog.Hash
	copy(wrong[:], cp.Root[:])
	wrong[0] ^= 1

	t.Run("signed with another key", func(t *testing.T) {
		dir := copyDir(t, src)
		writeFile(t, path(dir), sign(otherKey, formatCheckpoint(KeyName, 30, cp.Root)))
		expectProblems(t, dir, VerifyOptions{Key: pub}, want{ProblemCheckpointSignature, -1, -1, 30, ""})
	})
	t.Run("root edited", func(t *testing.T) {
		dir := copyDir(t, src)
		b := readFile(t, path(dir))
		writeFile(t, path(dir), []byte(strings.Replace(string(b), cp.Root.String(), wrong.String(), 1)))
		expectProblems(t, dir, VerifyOptions{Key: pub}, want{ProblemCheckpointSignature, -1, -1, 30, ""})
	})
	t.Run("wrong root under the real key", func(t *testing.T) {
		dir := copyDir(t, src)
		writeFile(t, path(dir), sign(ownKey, formatCheckpoint(KeyName, 30, wrong)))
		expectProblems(t, dir, VerifyOptions{Key: pub}, want{ProblemCheckpointRoot, -1, -1, 30, ""})
	})
	t.Run("renamed", func(t *testing.T) {
		dir := copyDir(t, src)
		writeFile(t, filepath.Join(dir, checkpointDir, checkpointName(31)), readFile(t, path(dir)))
		expectProblems(t, dir, VerifyOptions{Key: pub}, want{ProblemCheckpointSignature, -1, -1, 31, ""})
	})
	t.Run("key.pub replaced", func(t *testing.T) {
		// Checked against the key the reviewer holds, a log whose
		// key.pub and checkpoints were all replaced fails everywhere.
		dir := copyDir(t, src)
		for _, size := range []uint64{10, 20, 30, 40, 50} {
			p := filepath.Join(dir, checkpointDir, checkpointName(size))
			c, _ := ParseCheckpoint(readFile(t, p), pub)
			writeFile(t, p, sign(otherKey, formatCheckpoint(KeyName, size, c.Root)))
		}
		expectProblems(t, dir, VerifyOptions{Key: pub},
			want{ProblemCheckpointSignature, -1, -1, 10, ""}, want{ProblemCheckpointSignature, -1, -1, 50, ""})
		// And Open refuses to append to a log whose checkpoint it cannot verify.
		if _, err := Open(dir, Options{Logger: quiet}); !errorsIs(err, ErrCheckpointMismatch) {
			t.Errorf("Open: %v", err)
		}
	})
}

func TestVerifyTornTail(t *testing.T) {
	dir, _ := tamperLog(t)
	offs, size := frames(t, dir)
	last := offs[len(offs)-1]
	// A crash can leave the last frame part-written: Verify says so, and
	// Open cuts it (no checkpoint covers it here: Close wrote one at 50,
	// so remove that one to stand for a crash before it).
	os.Remove(filepath.Join(dir, checkpointDir, checkpointName(50)))
	os.Truncate(filepath.Join(dir, recordsFile), size-10)
	expectProblems(t, dir, VerifyOptions{}, want{ProblemTornTail, 49, last, -1, ""})
	l := openLog(t, dir, Options{})
	if rc := l.Recovered(); rc.TruncatedAt != last || rc.TruncatedBytes != size-10-last {
		t.Errorf("recovered %+v", rc)
	}
	l.Close()
	mustVerify(t, dir)
}
