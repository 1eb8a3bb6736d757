package audit

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/carrel-os/carrel/supervisor/internal/clocktest"
)

// segmentFiles lists segments/ (rotated segment files only).
func segmentFiles(t testing.TB, dir string) []string {
	t.Helper()
	segs, err := listSegments(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, s := range segs {
		if s.path != "" {
			out = append(out, s.name)
		}
	}
	return out
}

// firstRecord decodes the first record of records.log.
// hasFirstRecord reports whether records.log in dir holds a whole first
// record yet.
func hasFirstRecord(dir string) bool {
	f, err := os.Open(filepath.Join(dir, recordsFile))
	if err != nil {
		return false
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return false
	}
	_, _, err = newFrameReader(f, st.Size()).next()
	return err == nil
}

func firstRecord(t testing.TB, dir string) (Record, SegmentStart) {
	t.Helper()
	f, err := os.Open(filepath.Join(dir, recordsFile))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, _ := f.Stat()
	p, _, err := newFrameReader(f, st.Size()).next()
	if err != nil {
		t.Fatal(err)
	}
	rec, err := Decode(p)
	if err != nil {
		t.Fatal(err)
	}
	var d SegmentStart
	if rec.Kind == KindSegment {
		if err := json.Unmarshal(rec.Data, &d); err != nil {
			t.Fatal(err)
		}
	}
	return rec, d
}

// TestRollUnderLoad: eight writers, with intents and outcomes, across
// many rolls of a 16 KiB segment: every record verifies, the reader
// reads each once, in order, at offsets ReadRecord takes back, and
// records in old segments prove against the latest checkpoint.
func TestRollUnderLoad(t *testing.T) {
	dir := t.TempDir()
	l := openLog(t, dir, Options{SegmentBytes: 16 << 10})
	ctx := context.Background()
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := range 300 {
				if i%10 == 0 {
					p, err := l.Begin(ctx, Record{VM: "demo", Session: "ses_a", Provenance: Host, Data: json.RawMessage(`{"action":"exec"}`)})
					if err != nil {
						t.Error(err)
						return
					}
					if _, err := p.End(ctx, Record{Provenance: Host, Data: json.RawMessage(`{}`)}); err != nil {
						t.Error(err)
						return
					}
					continue
				}
				if _, err := l.Append(ctx, sample(w*1000+i)); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	// Size after Close: a roll due after the last batch writes the next
	// segment's first record after that batch's writers have returned.
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	size := l.Size()
	segs := segmentFiles(t, dir)
	if len(segs) < 10 {
		t.Fatalf("%d segments for %d records of 16 KiB segments", len(segs), size)
	}
	rep := mustVerify(t, dir)
	if rep.Records != size || rep.Segments != len(segs)+1 || rep.Latest != size || rep.OpenIntents != 0 {
		t.Errorf("verify: %d records in %d segments, latest %d, %d open; want %d in %d", rep.Records, rep.Segments, rep.Latest, rep.OpenIntents, size, len(segs)+1)
	}

	r, err := OpenReader(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	var offs []int64
	var payloads [][]byte
	end, err := r.Scan(func(seq uint64, off int64, p []byte) error {
		rec, err := Decode(p)
		if err != nil || rec.Seq != seq || seq != uint64(len(offs)) {
			t.Fatalf("record %d: seq %d, %v", len(offs), rec.Seq, err)
		}
		offs = append(offs, off)
		payloads = append(payloads, bytes.Clone(p))
		return nil
	})
	if err != nil || end.Records != size || end.TailBytes != 0 {
		t.Fatalf("scan: %+v, %v", end, err)
	}
	total, _ := r.Size()
	if end.Offset != total || total != rep.Bytes {
		t.Errorf("scan ended at %d, the log is %d bytes, verify says %d", end.Offset, total, rep.Bytes)
	}
	for _, i := range []int{0, 1, len(offs) / 3, len(offs) / 2, len(offs) - 1} {
		p, err := r.ReadRecord(offs[i])
		if err != nil || !bytes.Equal(p, payloads[i]) {
			t.Errorf("ReadRecord(%d) for record %d: %v", offs[i], i, err)
		}
	}
	// ScanFrom a middle segment's offset counts from there.
	var firstFrom uint64
	if _, err := r.ScanFrom(offs[len(offs)/2], func(seq uint64, off int64, p []byte) error {
		if seq == 0 {
			rec, _ := Decode(p)
			firstFrom = rec.Seq
		}
		return nil
	}); err != nil || firstFrom != uint64(len(offs)/2) {
		t.Errorf("ScanFrom: first record %d, %v", firstFrom, err)
	}
	cp, err := r.LatestCheckpoint("")
	if err != nil {
		t.Fatal(err)
	}
	pr, err := r.Prover(cp)
	if err != nil {
		t.Fatal(err)
	}
	defer pr.Close()
	for _, i := range []int{0, 5, len(offs) / 4} {
		if _, err := pr.Prove(uint64(i), payloads[i]); err != nil {
			t.Errorf("prove record %d: %v", i, err)
		}
	}
	// Each segment after the first starts with its audit.segment record.
	seqs := map[uint64]bool{}
	for _, name := range segs {
		first, _, _ := parseSegmentName(name)
		seqs[first] = true
	}
	for first := range seqs {
		if rec, _ := Decode(payloads[first]); first > 0 && rec.Kind != KindSegment {
			t.Errorf("segment at %d starts with %s", first, rec.Kind)
		}
	}
	// Open again reads only records.log, and goes on.
	l = openLog(t, dir, Options{SegmentBytes: 16 << 10})
	if l.Size() != size || l.Recovered().Records != size {
		t.Errorf("reopened: %d records, recovered %+v", l.Size(), l.Recovered())
	}
	appendN(t, l, 3)
	l.Close()
	mustVerify(t, dir)
}

// TestRollByAge: a segment whose first record is older than SegmentAge
// rolls after the next batch, and when idle, on the timer; one that holds
// only its first record does not.
func TestRollByAge(t *testing.T) {
	dir := t.TempDir()
	c := clocktest.New(time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC))
	l := openLog(t, dir, Options{SegmentAge: time.Hour, CheckpointInterval: 10 * time.Millisecond, now: c.Now})
	appendN(t, l, 3)
	if n := len(segmentFiles(t, dir)); n != 0 {
		t.Fatalf("%d segments before the hour", n)
	}
	c.Advance(61 * time.Minute)
	appendN(t, l, 1)
	// The roll renames records.log away, then starts a new one: wait for
	// its first record too.
	waitFor(t, func() bool { return len(segmentFiles(t, dir)) == 1 && hasFirstRecord(dir) })
	if got := segmentFiles(t, dir); got[0] != segmentName(0, 3) {
		t.Errorf("segments %v", got)
	}
	rec, d := firstRecord(t, dir)
	if rec.Seq != 4 || rec.Kind != KindSegment || d.Previous != segmentName(0, 3) || d.Records != 4 || !strings.Contains(d.Checkpoint, "\n4\n") {
		t.Errorf("first record of the new segment: %+v %+v", rec, d)
	}
	// An hour on with only its first record: it stays.
	c.Advance(2 * time.Hour)
	time.Sleep(50 * time.Millisecond)
	if n := len(segmentFiles(t, dir)); n != 1 {
		t.Fatalf("a segment of one record rolled: %d segments", n)
	}
	// One more record and idle: the timer rolls it.
	appendN(t, l, 1)
	waitFor(t, func() bool { return len(segmentFiles(t, dir)) == 2 })
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	rep := mustVerify(t, dir)
	if rep.Records != 7 || rep.Segments != 3 {
		t.Errorf("%d records in %d segments", rep.Records, rep.Segments)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for range 500 {
		if cond() {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatal("timed out")
}

// rolledOnce makes a log with an intent open across one roll, closed
// right after the roll, as a crash would leave it: without the
// checkpoints signed after the roll. It returns the seq of the intent and
// of the roll's audit.segment record.
func rolledOnce(t *testing.T) (dir string, intent, roll uint64) {
	dir = t.TempDir()
	l := openLog(t, dir, Options{SegmentBytes: 4 << 10})
	ctx := context.Background()
	p, err := l.Begin(ctx, Record{VM: "demo", Session: "ses_x", Provenance: Host, Data: json.RawMessage(`{"action":"exec"}`)})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; len(segmentFiles(t, dir)) == 0; i++ {
		if _, err := l.Append(ctx, sample(i)); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	_, last, _ := parseSegmentName(segmentFiles(t, dir)[0])
	roll = last + 1
	sizes, _ := listCheckpoints(dir)
	for _, n := range sizes {
		if n > roll {
			os.Remove(filepath.Join(dir, checkpointDir, checkpointName(n)))
		}
	}
	return dir, p.Seq(), roll
}

// TestRollCrash: a crash at each step of a roll loses nothing. Before
// the rename, records.log is whole; after it, Open finds no records.log,
// or an empty one, or a torn first record, and starts the segment again
// with its audit.segment record first, then the recovery; the intent
// left open across the roll gets its unknown outcome.
func TestRollCrash(t *testing.T) {
	src, intent, roll := rolledOnce(t)
	segName := segmentName(0, roll-1)
	recs := readFile(t, filepath.Join(src, recordsFile))
	offs, _ := frames(t, src)
	firstLen := len(recs)
	if len(offs) > 1 {
		firstLen = int(offs[1])
	}
	for name, crash := range map[string]func(t *testing.T, dir string){
		"before the rename": func(t *testing.T, dir string) {
			os.Remove(filepath.Join(dir, recordsFile))
			seg := filepath.Join(dir, segmentDir, segName)
			os.Chmod(seg, 0o600)
			if err := os.Rename(seg, filepath.Join(dir, recordsFile)); err != nil {
				t.Fatal(err)
			}
		},
		"after the rename":     func(t *testing.T, dir string) { os.Remove(filepath.Join(dir, recordsFile)) },
		"records.log created":  func(t *testing.T, dir string) { writeFile(t, filepath.Join(dir, recordsFile), nil) },
		"first record torn":    func(t *testing.T, dir string) { writeFile(t, filepath.Join(dir, recordsFile), recs[:firstLen/2]) },
		"first record durable": func(t *testing.T, dir string) { writeFile(t, filepath.Join(dir, recordsFile), recs[:firstLen]) },
		"no checkpoint at the end": func(t *testing.T, dir string) {
			os.Remove(filepath.Join(dir, recordsFile))
			os.Remove(filepath.Join(dir, checkpointDir, checkpointName(roll)))
		},
	} {
		t.Run(name, func(t *testing.T) {
			dir := copyDir(t, src)
			crash(t, dir)
			l := openLog(t, dir, Options{SegmentBytes: 4 << 10})
			if got := l.Recovered().UnknownOutcomes; !slices.Equal(got, []uint64{intent}) {
				t.Errorf("unknown outcomes %v, want [%d]", got, intent)
			}
			appendN(t, l, 2)
			if err := l.Close(); err != nil {
				t.Fatal(err)
			}
			rep := mustVerify(t, dir)
			if rep.OpenIntents != 0 {
				t.Errorf("%d intents open", rep.OpenIntents)
			}
			if name == "before the rename" {
				return // records.log holds them all: it rolls again later
			}
			rec, d := firstRecord(t, dir)
			if rec.Seq != roll || rec.Kind != KindSegment || d.Previous != segName || len(d.OpenIntents) != 1 || d.OpenIntents[0].Seq != intent {
				t.Errorf("records.log starts with %+v %+v", rec, d)
			}
		})
	}
}

// TestRollFault: when records.log cannot be made again after the rename,
// the log turns unavailable, and the probe starts the segment with its
// audit.segment record before its recovery record.
func TestRollFault(t *testing.T) {
	dir := t.TempDir()
	f := &faults{}
	opts := Options{open: f.open, RetryInterval: 5 * time.Millisecond, SegmentBytes: 4 << 10}
	ev := newEvents(&opts)
	l := openLog(t, dir, opts)
	ctx := context.Background()
	f.mu.Lock()
	f.file, f.openErr = recordsFile, syscall.EMFILE
	f.mu.Unlock()
	for len(segmentFiles(t, dir)) == 0 {
		if _, err := l.Append(ctx, sample(0)); errors.Is(err, ErrUnavailable) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
	}
	ev.waitFault(t)
	roll := l.Size()
	f.mu.Lock()
	f.openErr = nil
	f.mu.Unlock()
	ev.waitRecover(t)
	appendN(t, l, 1)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	mustVerify(t, dir)
	var kinds []string
	Scan(dir, func(seq uint64, _ int64, p []byte) error {
		if seq >= roll {
			rec, _ := Decode(p)
			kinds = append(kinds, rec.Kind)
		}
		return nil
	})
	if want := []string{KindSegment, KindRecovery, KindExecStart}; !slices.Equal(kinds, want) {
		t.Errorf("records after the roll: %v, want %v", kinds, want)
	}
}

// TestArchive: archived segments are reported and checked through the
// checkpoint at their end; --archive reads them back, and a changed copy
// is caught; a segment gone without a manifest is a problem.
func TestArchive(t *testing.T) {
	dir := t.TempDir()
	l := openLog(t, dir, Options{SegmentBytes: 8 << 10})
	appendN(t, l, 300)
	l.Close()
	size := l.Size()
	segs := segmentFiles(t, dir)
	if len(segs) < 4 {
		t.Fatalf("%d segments", len(segs))
	}
	to := t.TempDir()
	got, err := Archive(dir, to, ArchiveOptions{Keep: 1})
	if err != nil || len(got) != len(segs)-1 {
		t.Fatalf("archived %d of %d: %v", len(got), len(segs), err)
	}
	if left := segmentFiles(t, dir); !slices.Equal(left, segs[len(segs)-1:]) {
		t.Errorf("left %v", left)
	}
	last := got[len(got)-1]
	rep := mustVerify(t, dir)
	if rep.Records != size || len(rep.Archived) != len(got) || rep.From != last.LastSeq+1 || rep.Latest != size {
		t.Errorf("verify: %d records from %d, %d archived, latest %d", rep.Records, rep.From, len(rep.Archived), rep.Latest)
	}
	// The reader starts after them; the log opens and goes on.
	r, err := OpenReader(dir)
	if err != nil || r.First() != last.LastSeq+1 {
		t.Fatalf("reader: first %d, %v", r.First(), err)
	}
	r.Close()
	l = openLog(t, dir, Options{SegmentBytes: 8 << 10})
	appendN(t, l, 5)
	l.Close()

	full, err := Verify(dir, VerifyOptions{Archive: to})
	if err != nil || !full.OK() || full.From != 0 || len(full.Archived) != 0 {
		t.Fatalf("verify --archive: from %d, %d archived, %v, %v", full.From, len(full.Archived), full.Problems, err)
	}

	// A changed archived copy is named, and the check stops short of it.
	p := filepath.Join(to, got[1].Name)
	b := readFile(t, p)
	b[100] ^= 1
	os.Chmod(p, 0o600)
	writeFile(t, p, b)
	expectProblems(t, dir, VerifyOptions{Archive: to}, want{kind: ProblemSegment, seq: int64(got[1].FirstSeq), offset: -1, checkpoint: -1})

	// A segment gone with no manifest.
	dir2 := copyDir(t, dir)
	os.Remove(filepath.Join(dir2, segmentDir, got[0].Name+archivedExt))
	expectProblems(t, dir2, VerifyOptions{}, want{kind: ProblemSegment, seq: 0, offset: -1, checkpoint: -1})
}

// TestVerifySegmentChain: a segment whose first record does not commit to
// the one before is caught.
func TestVerifySegmentChain(t *testing.T) {
	dir := t.TempDir()
	l := openLog(t, dir, Options{SegmentBytes: 4 << 10})
	appendN(t, l, 60)
	l.Close()
	segs := segmentFiles(t, dir)
	if len(segs) < 2 {
		t.Fatalf("%d segments", len(segs))
	}
	// Two segments joined into one: the second's audit.segment is then
	// mid-segment, and the names do not add up.
	d := copyDir(t, dir)
	a, b := filepath.Join(d, segmentDir, segs[0]), filepath.Join(d, segmentDir, segs[1])
	_, lastB, _ := parseSegmentName(segs[1])
	joined := append(readFile(t, a), readFile(t, b)...)
	os.Remove(a)
	os.Remove(b)
	writeFile(t, filepath.Join(d, segmentDir, segmentName(0, lastB)), joined)
	rep, err := Verify(d, VerifyOptions{})
	if err != nil || rep.OK() {
		t.Fatalf("joined segments verify: %v %v", rep.Problems, err)
	}
	found := false
	for _, p := range rep.Problems {
		found = found || p.Kind == ProblemSegment
	}
	if !found {
		t.Errorf("no segment problem: %v", rep.Problems)
	}
}

// TestRollManyOpenIntents: more intents open at a roll than a record
// lists go to a blob the audit.segment record names; recovery and Verify
// read them from there.
func TestRollManyOpenIntents(t *testing.T) {
	dir := t.TempDir()
	l := openLog(t, dir, Options{SegmentBytes: 512 << 10})
	ctx := context.Background()
	const open = inlineIntents + 500
	for i := range open {
		if _, err := l.Begin(ctx, Record{VM: "demo", Session: "ses_x", Provenance: Host, Data: json.RawMessage(fmt.Sprintf(`{"action":"exec","n":%d}`, i))}); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; len(segmentFiles(t, dir)) == 0; i++ {
		if _, err := l.Append(ctx, sample(i)); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	rec, d := firstRecord(t, dir)
	if d.OpenIntentsBlob == "" || d.OpenIntentsCount != open || len(d.OpenIntents) != 0 || !slices.Contains(rec.Blobs, d.OpenIntentsBlob) {
		t.Fatalf("audit.segment with %d open intents: blob %q count %d inline %d, record blobs %v", open, d.OpenIntentsBlob, d.OpenIntentsCount, len(d.OpenIntents), rec.Blobs)
	}
	if rep := mustVerify(t, dir); rep.OpenIntents != open {
		t.Errorf("Verify counts %d open intents, want %d", rep.OpenIntents, open)
	}
	// As after a crash: every one gets its unknown outcome.
	l = openLog(t, dir, Options{SegmentBytes: 512 << 10})
	if got := len(l.Recovered().UnknownOutcomes); got != open {
		t.Errorf("recovery closed %d intents, want %d", got, open)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if rep := mustVerify(t, dir); rep.OpenIntents != 0 {
		t.Errorf("after recovery Verify counts %d open intents", rep.OpenIntents)
	}
	// A blob that lists other intents than the record counts is named.
	p, _ := BlobPath(dir, d.OpenIntentsBlob)
	os.Chmod(p, 0o600)
	writeFile(t, p, []byte("[]"))
	rep, err := Verify(dir, VerifyOptions{SkipBlobs: true})
	if err != nil {
		t.Fatal(err)
	}
	if rep.OK() || !strings.Contains(fmt.Sprint(rep.Problems), "lists 0 intents, the record says") {
		t.Errorf("a changed blob of open intents: %v", rep.Problems)
	}
}
