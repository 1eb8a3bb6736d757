package audit

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestRecoverCorrupt: a byte flipped in the middle of records.log keeps
// the log from opening, and says so; RecoverCorrupt seals the damaged log
// read-only, starts a new one chained to its last good checkpoint, and
// Verify then passes, naming the sealed log's unreadable record exactly.
func TestRecoverCorrupt(t *testing.T) {
	src, _ := tamperLog(t)
	dir := copyDir(t, src)
	offs, _ := frames(t, dir)
	path := filepath.Join(dir, recordsFile)
	b := readFile(t, path)
	b[offs[25]+8+40] ^= 0x04
	writeFile(t, path, b)
	if _, err := Open(dir, Options{Logger: quiet}); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Open: %v, want ErrCorrupt", err)
	}

	// A log that opens is not for recovering.
	if _, err := RecoverCorrupt(copyDir(t, src), time.Now()); err == nil || !strings.Contains(err.Error(), "opens cleanly") {
		t.Errorf("RecoverCorrupt of a sound log: %v", err)
	}

	at := time.Date(2026, 11, 27, 8, 0, 0, 0, time.UTC)
	s, err := RecoverCorrupt(dir, at)
	if err != nil {
		t.Fatal(err)
	}
	if got := s.Report.Unreadable(); !slices.Equal(got, []uint64{25}) {
		t.Errorf("unreadable %v, want [25]", got)
	}
	rel := filepath.Join(sealedDir, "20261127T080000Z")
	if s.Dir != filepath.Join(dir, rel) {
		t.Errorf("sealed in %s", s.Dir)
	}
	st, err := os.Stat(filepath.Join(s.Dir, recordsFile))
	if err != nil || st.Mode().Perm()&0o222 != 0 {
		t.Errorf("the sealed records: %v, mode %v", err, st.Mode())
	}

	// The new log opens, starts with the chain record, and takes records.
	l, err := Open(dir, Options{Logger: quiet})
	if err != nil {
		t.Fatalf("Open after the recovery: %v", err)
	}
	appendN(t, l, 3)
	l.Close()
	r, err := OpenReader(dir)
	if err != nil {
		t.Fatal(err)
	}
	var first Record
	r.Scan(func(seq uint64, _ int64, payload []byte) error {
		first, err = Decode(payload)
		return errors.New("stop")
	})
	r.Close()
	var d RecoveryData
	if first.Kind != KindRecovery || json.Unmarshal(first.Data, &d) != nil || d.Cause != "corruption" || d.Sealed != rel ||
		!slices.Equal(d.Unreadable, []uint64{25}) || !strings.HasPrefix(d.PreviousCheckpoint, KeyName+"\n") {
		t.Errorf("the new log's first record: %s %s", first.Kind, first.Data)
	}

	rep, err := Verify(dir, VerifyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !rep.OK() || rep.Records != 4 || len(rep.Sealed) != 1 || rep.Sealed[0].Dir != rel || !slices.Equal(rep.Sealed[0].Unreadable, []uint64{25}) {
		t.Errorf("verify after the recovery: %+v", rep)
	}

	// Damage to the sealed log after it was sealed is a problem.
	os.Chmod(filepath.Join(s.Dir, recordsFile), 0o644)
	sb := readFile(t, filepath.Join(s.Dir, recordsFile))
	sb[offs[40]+8+40] ^= 0x04
	writeFile(t, filepath.Join(s.Dir, recordsFile), sb)
	rep, err = Verify(dir, VerifyOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if rep.OK() || !slices.ContainsFunc(rep.Problems, func(p Problem) bool { return p.Kind == ProblemSealed && strings.Contains(p.Detail, "[25 40]") }) {
		t.Errorf("a sealed log damaged further: %+v", rep.Problems)
	}
}
