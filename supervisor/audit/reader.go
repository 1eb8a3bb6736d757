package audit

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"
)

// Reader reads a log's files without taking its lock and without writing:
// for review tools, which work on a log that carreld may be appending to,
// or on a copy of one. It reads the log's segments as one stream, with
// the byte offsets of the whole log, from the first segment its
// directory holds (First): older ones may be archived. Segments rolled
// after OpenReader are not read; records.log's growth is.
type Reader struct {
	dir   string
	src   *stream
	start int64  // the offset of the first record read
	first uint64 // its seq
}

// OpenReader opens the log in dir for reading.
func OpenReader(dir string) (*Reader, error) {
	src, _, err := openStream(dir)
	if err != nil {
		return nil, fmt.Errorf("open audit log: %w", err)
	}
	r := &Reader{dir: dir, src: src}
	r.start, r.first = src.start()
	return r, nil
}

// Dir is the log's directory.
func (r *Reader) Dir() string { return r.dir }

// First is the seq of the first record the reader reads: 0, unless older
// segments are archived (or missing: carrel audit verify says which).
func (r *Reader) First() uint64 { return r.first }

// Size is the log's size now: the offset just after its last byte.
func (r *Reader) Size() (int64, error) {
	n, err := r.src.end()
	if err != nil {
		return 0, fmt.Errorf("audit log: %w", err)
	}
	return n, nil
}

// Close closes the log's files.
func (r *Reader) Close() error { return r.src.Close() }

// ScanEnd says where a Reader's scan stopped.
type ScanEnd struct {
	// Records is how many complete records were read.
	Records uint64
	// Offset is the byte offset just after the last of them.
	Offset int64
	// TailBytes follow Offset without being a whole record yet: an append
	// in progress, or a crash's torn tail that carreld cuts on its next
	// start. TailReason says what is wrong with them.
	TailBytes  int64
	TailReason string
}

// Scan calls fn for each complete record of the log as it is when Scan
// starts, in order from First, with its seq (its index), its byte offset
// and its payload, valid only during the call. A bad last frame with no good
// frame after it, which is what a concurrent append leaves, ends the scan
// without error (ScanEnd says so); a bad frame with good ones after it is
// a *CorruptError. Scan does not check seq fields or hashes: Verify does.
// ScanEnd.Records is the seq after the last record read.
func (r *Reader) Scan(fn func(seq uint64, offset int64, payload []byte) error) (ScanEnd, error) {
	size, err := r.Size()
	if err != nil {
		return ScanEnd{}, fmt.Errorf("scan audit log: %w", err)
	}
	fr := newFrameReader(r.src, size)
	fr.seek(r.start)
	return r.scan(fr, r.first, fn)
}

// ScanFrom is Scan from the first record that starts at byte offset from
// or after it, for reading the end of a long log without reading all of
// it. fn's seq, and a *CorruptError's, count the records from there (0
// for the first): the records' own seq fields say where they are in the
// log. ScanEnd.Records counts the records read.
func (r *Reader) ScanFrom(from int64, fn func(seq uint64, offset int64, payload []byte) error) (ScanEnd, error) {
	size, err := r.Size()
	if err != nil {
		return ScanEnd{}, fmt.Errorf("scan audit log: %w", err)
	}
	fr := newFrameReader(r.src, size)
	fr.seek(r.start)
	if from > r.start {
		// A good frame whose payload begins like a record: what a record's
		// JSON holds cannot look like one, since it quotes what it carries.
		start, err := fr.resync(from - 1)
		if err != nil {
			return ScanEnd{}, fmt.Errorf("scan audit log %s: %w", r.dir, err)
		}
		if start < 0 {
			return ScanEnd{Offset: size}, nil
		}
		fr.seek(start)
	}
	return r.scan(fr, 0, fn)
}

func (r *Reader) scan(fr *frameReader, first uint64, fn func(seq uint64, offset int64, payload []byte) error) (ScanEnd, error) {
	for seq := first; ; seq++ {
		p, off, err := fr.next()
		if errors.Is(err, io.EOF) {
			return ScanEnd{Records: seq, Offset: off}, nil
		}
		var fe *frameError
		if errors.As(err, &fe) {
			next, rerr := fr.resync(off)
			if rerr != nil {
				return ScanEnd{}, fmt.Errorf("scan audit log %s: %w", r.dir, rerr)
			}
			if next >= 0 {
				return ScanEnd{}, &CorruptError{Offset: off, Seq: seq, Reason: fe.reason}
			}
			return ScanEnd{Records: seq, Offset: off, TailBytes: fr.size - off, TailReason: fe.reason}, nil
		}
		if err != nil {
			return ScanEnd{}, fmt.Errorf("scan audit log %s: %w", r.dir, err)
		}
		if err := fn(seq, off, p); err != nil {
			return ScanEnd{}, err
		}
	}
}

// ReadRecord returns the payload of the frame at byte offset off, as Scan
// gave it.
func (r *Reader) ReadRecord(off int64) ([]byte, error) {
	size, err := r.Size()
	if err != nil {
		return nil, fmt.Errorf("read audit record: %w", err)
	}
	fr := &frameReader{r: r.src, size: size, buf: make([]byte, min(int64(maxFrameSize), max(size-off, 0)))}
	fr.seek(off)
	p, _, err := fr.next()
	if err != nil {
		return nil, fmt.Errorf("read audit record at offset %d: %w", off, err)
	}
	return append([]byte(nil), p...), nil
}

// LatestCheckpoint returns the log's largest checkpoint, checked against
// key, or key.pub in the log's directory when key is empty (which proves
// less: whoever can rewrite the log can rewrite key.pub). It returns nil
// when the log has no checkpoint yet, and a *CheckpointError when the
// largest one does not verify.
func (r *Reader) LatestCheckpoint(key string) (*Checkpoint, error) {
	if key == "" {
		k, err := PublicKey(r.dir)
		if err != nil {
			return nil, err
		}
		key = k
	}
	v, err := note.NewVerifier(key)
	if err != nil {
		return nil, fmt.Errorf("verifier key: %w", err)
	}
	return latestCheckpoint(r.dir, note.VerifierList(v))
}

// Prover makes RFC 6962 inclusion proofs against one checkpoint's tree.
// It reads the tree from hashes.db when that reproduces the checkpoint's
// root, and otherwise recomputes it from records.log into a temporary
// file, so a lagging, rebuilt or damaged hashes.db costs time, never a
// wrong proof: every proof is checked before Prove returns it.
type Prover struct {
	r          *Reader
	cp         Checkpoint
	hashes     *os.File // hashes.db, or the recomputed hashes
	recomputed bool
}

// Prover returns a prover for cp's tree. records.log must hold at least
// cp.Size records.
func (r *Reader) Prover(cp *Checkpoint) (*Prover, error) {
	p := &Prover{r: r, cp: *cp}
	if f, err := os.Open(filepath.Join(r.dir, hashesFile)); err == nil {
		st, err := f.Stat()
		if err == nil && st.Size() >= storedCount(cp.Size)*tlog.HashSize {
			if t, err := loadTree(cp.Size, hashFile{osFile{f}}); err == nil && t.root() == cp.Root {
				p.hashes = f
				return p, nil
			}
		}
		f.Close()
	}
	if err := p.recompute(); err != nil {
		return nil, err
	}
	return p, nil
}

// recompute hashes the first cp.Size records of the log into a
// temporary file of stored hashes, laid out as hashes.db.
func (p *Prover) recompute() error {
	if p.hashes != nil {
		p.closeHashes()
	}
	if p.r.first > 0 {
		return &CheckpointError{Size: p.cp.Size, Reason: fmt.Sprintf("hashes.db does not reproduce it, and records before %d, archived, are needed to recompute it (run carrel audit verify)", p.r.first)}
	}
	p.recomputed = true
	f, err := os.CreateTemp("", "carrel-audit-hashes-*")
	if err != nil {
		return fmt.Errorf("recompute audit tree: %w", err)
	}
	os.Remove(f.Name()) // unlinked: it goes when it is closed
	p.hashes = f
	w := bufio.NewWriterSize(f, 1<<20)
	var t tree
	var stored []tlog.Hash
	lh := newLeafHasher()
	errDone := errors.New("done")
	_, err = p.r.Scan(func(seq uint64, _ int64, payload []byte) error {
		if seq >= p.cp.Size {
			return errDone
		}
		stored = t.push(lh.sum(payload), stored[:0])
		for _, h := range stored {
			if _, err := w.Write(h[:]); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil && !errors.Is(err, errDone) {
		return fmt.Errorf("recompute audit tree: %w", err)
	}
	if err := w.Flush(); err != nil {
		return fmt.Errorf("recompute audit tree: %w", err)
	}
	if t.n < p.cp.Size {
		return &LostError{Checkpoint: p.cp.Size, Records: t.n}
	}
	if root := t.root(); root != p.cp.Root {
		return &CheckpointError{Size: p.cp.Size, Reason: fmt.Sprintf("the records hash to %s, the checkpoint says %s (run carrel audit verify)", root, p.cp.Root)}
	}
	return nil
}

// Prove returns the proof that payload is record seq of the checkpoint's
// tree, checked against its root.
func (p *Prover) Prove(seq uint64, payload []byte) (tlog.RecordProof, error) {
	if seq >= p.cp.Size {
		return nil, fmt.Errorf("record %d is not in the checkpoint's tree of %d", seq, p.cp.Size)
	}
	for {
		proof, err := tlog.ProveRecord(int64(p.cp.Size), int64(seq), hashFile{osFile{p.hashes}})
		if err == nil {
			err = CheckProof(proof, p.cp.Size, p.cp.Root, seq, payload)
		}
		if err == nil {
			return proof, nil
		}
		if p.recomputed {
			return nil, &CheckpointError{Size: p.cp.Size, Reason: fmt.Sprintf("record %d is not in its tree: %v (run carrel audit verify)", seq, err)}
		}
		if err := p.recompute(); err != nil {
			return nil, err
		}
	}
}

func (p *Prover) closeHashes() error {
	err := p.hashes.Close()
	p.hashes = nil
	return err
}

// Close releases the prover's files.
func (p *Prover) Close() error {
	if p.hashes == nil {
		return nil
	}
	return p.closeHashes()
}
