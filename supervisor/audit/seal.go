package audit

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"time"
)

// sealedDir holds the logs carrel audit recover sealed, one directory each,
// named by the time of the recovery.
const sealedDir = "sealed"

// Sealed is what RecoverCorrupt did.
type Sealed struct {
	// Dir is where the damaged log now lies, read-only: its records.log,
	// hashes.db and checkpoints, with links to the log's blobs and key.pub
	// so that the review tools read it as a log of its own.
	Dir string
	// Report is Verify's report of the sealed log: its problems name the
	// unreadable records exactly.
	Report *Report
	// Records is how many records the new log's first, an
	// "audit.recovery" of cause "corruption", follows: 0, it starts a new
	// tree.
	Records uint64
}

// RecoverCorrupt is the explicit step after a log Open refuses as damaged
// (ErrCorrupt, ErrRecordsLost): it never runs by itself. With the log's
// lock held (carreld stopped), it verifies the log, seals its records
// (records.log and segments/), hashes and checkpoints as evidence under sealed/TIME/, read-only, and
// starts a new log in dir, with the same key and blobs, whose first record
// (an "audit.recovery" of cause "corruption") names the sealed log, its
// unreadable records, and the last of its checkpoints that its readable
// records match, signed: the new log is chained to it. Verify then checks
// the sealed logs too. It refuses a log that opens cleanly.
func RecoverCorrupt(dir string, now time.Time) (*Sealed, error) {
	switch l, err := Open(dir, Options{}); {
	case err == nil:
		l.Close()
		return nil, fmt.Errorf("recover %s: the log opens cleanly: nothing to recover", dir)
	case errors.Is(err, ErrLocked):
		return nil, fmt.Errorf("recover %s: %w: stop carreld first", dir, err)
	case !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrRecordsLost):
		return nil, fmt.Errorf("recover %s: the log does not open, for another reason than damage: %w", dir, err)
	}
	lock, err := os.OpenFile(filepath.Join(dir, lockFile), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		return nil, fmt.Errorf("recover %s: %w: stop carreld first", dir, ErrLocked)
	}
	rep, err := Verify(dir, VerifyOptions{SkipBlobs: true})
	if err != nil {
		return nil, fmt.Errorf("recover %s: %w", dir, err)
	}
	var cp []byte
	if rep.Latest > 0 {
		if cp, err = readCheckpoint(dir, rep.Latest); err != nil {
			return nil, err
		}
	}
	rel := filepath.Join(sealedDir, now.UTC().Format("20060102T150405Z"))
	sealed := filepath.Join(dir, rel)
	if err := os.MkdirAll(sealed, 0o700); err != nil {
		return nil, err
	}
	for _, name := range []string{recordsFile, segmentDir, hashesFile, checkpointDir, witnessesDir} {
		if err := os.Rename(filepath.Join(dir, name), filepath.Join(sealed, name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("seal %s: %w", name, err)
		}
	}
	for _, name := range []string{blobDir, keyPubFile} {
		if err := os.Symlink(filepath.Join("..", "..", name), filepath.Join(sealed, name)); err != nil {
			return nil, fmt.Errorf("seal: link %s: %w", name, err)
		}
	}
	report, _ := json.MarshalIndent(rep, "", "  ")
	if err := os.WriteFile(filepath.Join(sealed, "verify.json"), append(report, '\n'), 0o444); err != nil {
		return nil, err
	}
	if err := readOnly(sealed); err != nil {
		return nil, fmt.Errorf("seal read-only: %w", err)
	}
	// The lock is the new log's from here on.
	lock.Close()
	l, err := Open(dir, Options{})
	if err != nil {
		return nil, fmt.Errorf("start the new log: %w", err)
	}
	data, err := json.Marshal(RecoveryData{Cause: "corruption", Sealed: rel, SealedRecords: rep.Records,
		Unreadable: rep.Unreadable(), PreviousCheckpoint: string(cp)})
	if err == nil {
		_, err = l.Append(context.Background(), Record{Kind: KindRecovery, Provenance: Host, Data: data})
	}
	if cerr := l.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("record the recovery in the new log: %w", err)
	}
	return &Sealed{Dir: sealed, Report: rep}, nil
}

// witnessesDir is where witness progress is kept (witness.Pusher): a new
// log starts it again.
const witnessesDir = "witnesses"

// Unreadable lists the records the report found damaged (a frame, its
// CRC or its record unreadable), by seq.
func (rep *Report) Unreadable() []uint64 {
	var out []uint64
	for _, p := range rep.Problems {
		switch p.Kind {
		case ProblemFrame, ProblemCRC, ProblemRecord:
			if p.Seq != nil && len(out) < 10000 {
				out = append(out, *p.Seq)
			}
		}
	}
	return out
}

// readOnly takes write permission from everything under dir, and dir.
func readOnly(dir string) error {
	return filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.Type()&fs.ModeSymlink != 0 {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		return os.Chmod(p, info.Mode().Perm()&^0o222)
	})
}
