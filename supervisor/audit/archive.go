package audit

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/carrel-os/carrel/supervisor/atomicfile"
)

// ArchiveOptions choose the rotated segments Archive moves: the oldest
// ones, in order, up to the first that either spares.
type ArchiveOptions struct {
	// Before spares a segment last written at or after it (zero: none).
	Before time.Time
	// Keep spares the newest Keep rotated segments.
	Keep int
	// Now is the manifests' archived_at (default: time.Now).
	Now time.Time
}

// Archive moves the oldest rotated segments of the log in dir to the
// directory to, never records.log. For each, it copies the file to
// to/<name> and syncs it, reads the copy back and compares its sha256,
// writes the manifest segments/<name>.archived (atomically; with the
// signed checkpoint at the segment's end), and only then removes the
// segment. It may run while carreld appends: rotated segments do not
// change. It returns the manifests it wrote; after a failure, those of
// the segments it moved before.
func Archive(dir, to string, opts ArchiveOptions) ([]ArchivedSegment, error) {
	if opts.Now.IsZero() {
		opts.Now = time.Now()
	}
	to, err := filepath.Abs(to)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(to, 0o700); err != nil {
		return nil, fmt.Errorf("archive: %w", err)
	}
	segs, err := listSegments(dir)
	if err != nil {
		return nil, err
	}
	var present []int
	for i, s := range segs {
		if s.path != "" {
			present = append(present, i)
		}
	}
	var out []ArchivedSegment
	for k, i := range present {
		if len(present)-k <= opts.Keep {
			break
		}
		s := segs[i]
		st, err := os.Stat(s.path)
		if err != nil {
			return out, fmt.Errorf("archive %s: %w", s.name, err)
		}
		if !opts.Before.IsZero() && !st.ModTime().Before(opts.Before) {
			break
		}
		cp, err := checkpointAfter(dir, segs, i)
		if err != nil {
			return out, fmt.Errorf("archive %s: %w", s.name, err)
		}
		m, err := archiveOne(dir, to, s, cp, opts.Now)
		if err != nil {
			return out, fmt.Errorf("archive %s: %w", s.name, err)
		}
		out = append(out, *m)
	}
	return out, nil
}

func archiveOne(dir, to string, s segment, cp []byte, now time.Time) (*ArchivedSegment, error) {
	src, err := os.Open(s.path)
	if err != nil {
		return nil, err
	}
	defer src.Close()
	h := sha256.New()
	dst := filepath.Join(to, s.name)
	if err := atomicfile.Write(dst, 0o444, func(w io.Writer) error {
		_, err := io.Copy(w, io.TeeReader(src, h))
		return err
	}); err != nil {
		return nil, fmt.Errorf("copy to %s: %w", to, err)
	}
	sum := hex.EncodeToString(h.Sum(nil))
	got, n, err := fileSHA256(dst)
	if err != nil {
		return nil, fmt.Errorf("read the copy back: %w", err)
	}
	if got != sum || n != s.bytes {
		return nil, fmt.Errorf("the copy %s reads back as %d bytes, sha256 %s; the segment is %d bytes, sha256 %s", dst, n, got, s.bytes, sum)
	}
	m := &ArchivedSegment{Name: s.name, FirstSeq: s.first, LastSeq: s.last, Bytes: s.bytes, SHA256: sum,
		ArchivedTo: to, ArchivedAt: now.UTC(), Checkpoint: string(cp)}
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return nil, err
	}
	if err := atomicfile.WriteFile(filepath.Join(dir, segmentDir, s.name+archivedExt), append(b, '\n'), 0o444); err != nil {
		return nil, fmt.Errorf("write its manifest: %w", err)
	}
	if err := os.Remove(s.path); err != nil {
		return nil, err
	}
	return m, atomicfile.SyncDir(filepath.Join(dir, segmentDir))
}

// checkpointAfter is the signed checkpoint at the end of segment i: the
// one the next segment's first record commits to, or, failing that, the
// one in checkpoints/.
func checkpointAfter(dir string, segs []segment, i int) ([]byte, error) {
	next := filepath.Join(dir, recordsFile)
	if i+1 < len(segs) {
		next = segs[i+1].path
	}
	if next != "" {
		if cp, err := segmentCheckpoint(next); err == nil {
			return cp, nil
		}
	}
	cp, err := readCheckpoint(dir, segs[i].last+1)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("no signed checkpoint at its end (%d records)", segs[i].last+1)
	}
	return cp, err
}

// segmentCheckpoint is the checkpoint the audit.segment record that
// starts the segment file at path commits to.
func segmentCheckpoint(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	fr := newFrameReader(f, min(st.Size(), int64(maxFrameSize)))
	p, _, err := fr.next()
	if err != nil {
		return nil, err
	}
	rec, err := Decode(p)
	if err != nil {
		return nil, err
	}
	var d SegmentStart
	if rec.Kind != KindSegment || json.Unmarshal(rec.Data, &d) != nil || d.Checkpoint == "" {
		return nil, fmt.Errorf("%s does not start with an %s record", filepath.Base(path), KindSegment)
	}
	return []byte(d.Checkpoint), nil
}
