package audit

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// readerLog writes n records, checkpointed at n, and returns the
// directory and the payloads.
func readerLog(t *testing.T, n int) (string, [][]byte) {
	t.Helper()
	dir := t.TempDir()
	l := openLog(t, dir, Options{CheckpointInterval: time.Hour})
	appendN(t, l, n)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	var payloads [][]byte
	if err := Scan(dir, func(_ uint64, _ int64, p []byte) error {
		payloads = append(payloads, bytes.Clone(p))
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return dir, payloads
}

func openTestReader(t *testing.T, dir string) *Reader {
	t.Helper()
	r, err := OpenReader(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

func TestReaderScan(t *testing.T) {
	dir, payloads := readerLog(t, 20)
	r := openTestReader(t, dir)
	var got [][]byte
	var offs []int64
	end, err := r.Scan(func(seq uint64, off int64, p []byte) error {
		if seq != uint64(len(got)) {
			t.Errorf("seq %d at position %d", seq, len(got))
		}
		got = append(got, bytes.Clone(p))
		offs = append(offs, off)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	st, _ := os.Stat(filepath.Join(dir, recordsFile))
	if len(got) != 20 || end.Records != 20 || end.Offset != st.Size() || end.TailBytes != 0 {
		t.Fatalf("%d records, end %+v", len(got), end)
	}
	for i := range got {
		if !bytes.Equal(got[i], payloads[i]) {
			t.Errorf("record %d differs", i)
		}
		p, err := r.ReadRecord(offs[i])
		if err != nil || !bytes.Equal(p, payloads[i]) {
			t.Errorf("ReadRecord(%d): %q, %v", offs[i], p, err)
		}
	}

	// A frame being appended (or torn) at the end: not an error.
	f, _ := os.OpenFile(filepath.Join(dir, recordsFile), os.O_WRONLY|os.O_APPEND, 0)
	f.Write([]byte{100, 0, 0, 0, 9, 9, 9, 9, '{', '"'})
	f.Close()
	n := 0
	end, err = r.Scan(func(uint64, int64, []byte) error { n++; return nil })
	if err != nil || n != 20 || end.Records != 20 || end.Offset != st.Size() || end.TailBytes != 10 || end.TailReason == "" {
		t.Errorf("torn tail: %d records, end %+v, %v", n, end, err)
	}

	// Damage with good frames after it is corruption.
	b := readFile(t, filepath.Join(dir, recordsFile))
	b[offs[5]+8+3] ^= 1
	writeFile(t, filepath.Join(dir, recordsFile), b)
	_, err = r.Scan(func(uint64, int64, []byte) error { return nil })
	var ce *CorruptError
	if !errors.As(err, &ce) || ce.Seq != 5 || ce.Offset != offs[5] {
		t.Errorf("damaged record 5: %v", err)
	}

	// Scan stops at the callback's error.
	stop := errors.New("stop")
	if _, err := r.Scan(func(uint64, int64, []byte) error { return stop }); err != stop {
		t.Errorf("callback error: %v", err)
	}
}

// TestReaderScanFrom: a scan from any byte offset starts at the first
// record at or after it, and reads to the end as Scan does.
func TestReaderScanFrom(t *testing.T) {
	dir, payloads := readerLog(t, 20)
	r := openTestReader(t, dir)
	var offs []int64
	if _, err := r.Scan(func(_ uint64, off int64, _ []byte) error { offs = append(offs, off); return nil }); err != nil {
		t.Fatal(err)
	}
	st, _ := os.Stat(filepath.Join(dir, recordsFile))
	for _, tc := range []struct {
		from  int64
		first int // the first record read; 20 for none
	}{
		{0, 0}, {offs[7], 7}, {offs[7] + 1, 8}, {offs[8] - 1, 8}, {offs[19], 19}, {offs[19] + 1, 20}, {st.Size(), 20}, {st.Size() + 100, 20},
	} {
		var got [][]byte
		end, err := r.ScanFrom(tc.from, func(seq uint64, off int64, p []byte) error {
			if seq != uint64(len(got)) || off != offs[tc.first+len(got)] {
				t.Errorf("from %d: seq %d offset %d at position %d", tc.from, seq, off, len(got))
			}
			got = append(got, bytes.Clone(p))
			return nil
		})
		if err != nil || len(got) != 20-tc.first || end.Records != uint64(len(got)) || end.TailBytes != 0 {
			t.Errorf("from %d: %d records, end %+v, %v; want %d", tc.from, len(got), end, err, 20-tc.first)
			continue
		}
		for i := range got {
			if !bytes.Equal(got[i], payloads[tc.first+i]) {
				t.Errorf("from %d: record %d differs", tc.from, tc.first+i)
			}
		}
	}
}

// TestReaderWhileAppending reads a log that a Log has open and appends
// to: the reader takes no lock, and sees a prefix of the records.
func TestReaderWhileAppending(t *testing.T) {
	dir := t.TempDir()
	l := openLog(t, dir, Options{CheckpointEvery: 7})
	defer l.Close()
	appendN(t, l, 10)
	r := openTestReader(t, dir)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 200 {
			if _, err := l.Append(context.Background(), sample(i)); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	for {
		var last uint64
		end, err := r.Scan(func(seq uint64, _ int64, p []byte) error {
			rec, err := Decode(p)
			if err != nil || rec.Seq != seq {
				t.Errorf("record %d: %v", seq, err)
			}
			last = seq
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if end.Records < 10 || last != end.Records-1 {
			t.Fatalf("end %+v, last %d", end, last)
		}
		select {
		case <-done:
			return
		default:
		}
	}
}

func TestProver(t *testing.T) {
	for name, damage := range map[string]func(dir string){
		"hashes.db":          func(string) {},
		"no hashes.db":       func(dir string) { os.Remove(filepath.Join(dir, hashesFile)) },
		"hashes.db cut":      func(dir string) { os.Truncate(filepath.Join(dir, hashesFile), 100) },
		"hashes.db damaged":  func(dir string) { damageAt(t, filepath.Join(dir, hashesFile), 0) },
		"hashes.db, a proof": func(dir string) { damageAt(t, filepath.Join(dir, hashesFile), 32*3) }, // leaf 2's sibling: the root still checks
	} {
		t.Run(name, func(t *testing.T) {
			dir, payloads := readerLog(t, 37)
			damage(dir)
			r := openTestReader(t, dir)
			cp, err := r.LatestCheckpoint("")
			if err != nil || cp == nil || cp.Size != 37 {
				t.Fatalf("checkpoint %+v, %v", cp, err)
			}
			p, err := r.Prover(cp)
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			for seq, payload := range payloads {
				proof, err := p.Prove(uint64(seq), payload)
				if err != nil {
					t.Fatalf("record %d: %v", seq, err)
				}
				if err := CheckProof(proof, cp.Size, cp.Root, uint64(seq), payload); err != nil {
					t.Errorf("record %d: proof does not check: %v", seq, err)
				}
			}
			if _, err := p.Prove(3, []byte(`{"seq":3}`)); !errors.Is(err, ErrCheckpointMismatch) {
				t.Errorf("a payload that is not record 3: %v", err)
			}
			if _, err := p.Prove(37, payloads[0]); err == nil {
				t.Error("a record past the checkpoint proved")
			}
		})
	}
}

func damageAt(t *testing.T, path string, off int) {
	t.Helper()
	b := readFile(t, path)
	b[off] ^= 0xff
	writeFile(t, path, b)
}

func TestProverRecordsChanged(t *testing.T) {
	dir, _ := readerLog(t, 12)
	// A record changed and resealed: hashes.db still matches the
	// checkpoint, but the record does not.
	offs, _ := frames(t, dir)
	path := filepath.Join(dir, recordsFile)
	b := readFile(t, path)
	b[offs[4]+8+20] ^= 1
	resealFrame(b, offs[4])
	writeFile(t, path, b)
	r := openTestReader(t, dir)
	cp, _ := r.LatestCheckpoint("")
	p, err := r.Prover(cp)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	payload, _ := r.ReadRecord(offs[4])
	if _, err := p.Prove(4, payload); !errors.Is(err, ErrCheckpointMismatch) {
		t.Errorf("changed record: %v", err)
	}
	// Recomputing from the records does not reproduce the root either.
	os.Remove(filepath.Join(dir, hashesFile))
	if _, err := r.Prover(cp); !errors.Is(err, ErrCheckpointMismatch) {
		t.Errorf("prover over changed records: %v", err)
	}
	// Records lost below the checkpoint.
	os.Truncate(path, offs[6])
	if _, err := r.Prover(cp); !errors.Is(err, ErrRecordsLost) {
		t.Errorf("prover over cut records: %v", err)
	}
}

func TestReaderCheckpointKey(t *testing.T) {
	dir, _ := readerLog(t, 3)
	r := openTestReader(t, dir)
	k, _ := PublicKey(dir)
	if cp, err := r.LatestCheckpoint(k); err != nil || cp.Size != 3 {
		t.Errorf("with the key: %+v, %v", cp, err)
	}
	other := t.TempDir()
	l := openLog(t, other, Options{})
	l.Close()
	k2, _ := PublicKey(other)
	if _, err := r.LatestCheckpoint(k2); !errors.Is(err, ErrCheckpointMismatch) {
		t.Errorf("with another log's key: %v", err)
	}
	empty := t.TempDir()
	l = openLog(t, empty, Options{})
	l.Close()
	if cp, err := openTestReader(t, empty).LatestCheckpoint(""); cp != nil || err != nil {
		t.Errorf("a log without records: %+v, %v", cp, err)
	}
}
