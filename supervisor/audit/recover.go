package audit

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"time"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"
)

// Recovery says what Open repaired.
type Recovery struct {
	// Records is how many records survived, before the ones recovery
	// appended.
	Records uint64
	// TruncatedAt and TruncatedBytes locate the torn tail Open cut
	// (TruncatedBytes is 0 when there was none); TailReason says what was
	// wrong with its first frame.
	TruncatedAt    int64
	TruncatedBytes int64
	TailReason     string
	// UnknownOutcomes are the seqs of the intents that had no outcome;
	// each now has one saying "unknown".
	UnknownOutcomes []uint64
	// Checkpoint is the size of the latest checkpoint, which the records
	// matched; 0 when there was none.
	Checkpoint uint64
	// HashesFrom is the first record whose stored hashes were recomputed.
	HashesFrom uint64
}

// unknownReason is OutcomeData.Reason for an intent a crash left open.
const unknownReason = "carreld stopped before the action finished"

type openIntent struct{ vm, session string }

// recover brings the files to a consistent state before the committer
// starts: see the package documentation. It reads records.log, the live
// segment, and older segments only to rebuild hashes.db where it lags
// behind into them.
func (l *Log) recover() error {
	v, err := note.NewVerifier(l.vkey)
	if err != nil {
		return err
	}
	cp, err := latestCheckpoint(l.dir, note.VerifierList(v))
	if err != nil {
		return err
	}
	segs, err := listSegments(l.dir)
	if err != nil {
		return err
	}
	l.segFirst, l.segBase = liveStart(segs)
	recSize, err := l.rec.Size()
	if err != nil {
		return fmt.Errorf("stat %s: %w", recordsFile, err)
	}
	hashSize, err := l.hash.Size()
	if err != nil {
		return fmt.Errorf("stat %s: %w", hashesFile, err)
	}

	// hashes.db is synced before each checkpoint: trust it up to the
	// latest one if it reproduces that root, and rebuild the rest.
	t, k := &tree{}, uint64(0)
	if cp != nil && storedCount(cp.Size)*tlog.HashSize <= hashSize {
		if ct, err := loadTree(cp.Size, hashFile{l.hash}); err == nil && ct.root() == cp.Root {
			t, k = ct, cp.Size
		}
	}
	l.tree, l.hashN = t, storedCount(k)
	if hashSize != l.hashN*tlog.HashSize {
		if err := l.hash.Truncate(l.hashN * tlog.HashSize); err != nil {
			return fmt.Errorf("truncate %s: %w", hashesFile, err)
		}
	}
	if k < l.segFirst {
		if err := l.rehashSegments(segs, k, cp); err != nil {
			return err
		}
	}

	fr := newFrameReader(l.rec, recSize)
	var h header
	open := map[uint64]openIntent{}
	n := l.segFirst
	end := recSize
	for {
		p, off, err := fr.next()
		if err == io.EOF {
			break
		}
		var fe *frameError
		if errors.As(err, &fe) {
			if why := tornTail(fr, off); why != "" {
				return &CorruptError{Offset: l.segBase + off, Seq: n, Reason: fe.reason + ", " + why}
			}
			end, l.rcv.TailReason = off, fe.reason
			break
		}
		if err != nil {
			return err
		}
		if err := parseHeader(p, &h); err != nil {
			return &CorruptError{Offset: l.segBase + off, Seq: n, Reason: err.Error()}
		}
		if h.seq != n {
			return &CorruptError{Offset: l.segBase + off, Seq: n, Reason: fmt.Sprintf("the record there says seq %d", h.seq)}
		}
		if n == l.segFirst {
			l.segDeadline = l.opts.now().Add(l.opts.SegmentAge)
			if at, err := time.Parse(time.RFC3339Nano, string(h.time)); err == nil {
				l.segDeadline = at.Add(l.opts.SegmentAge)
			}
			if n > 0 && len(segs) > 0 {
				if err := seedIntents(l.dir, p, &h, open); err != nil {
					return &CorruptError{Offset: l.segBase + off, Seq: n, Reason: err.Error()}
				}
			}
		}
		if n >= k {
			if err := l.rehash(p, cp); err != nil {
				return err
			}
		}
		if string(h.kind) == KindIntent {
			open[n] = openIntent{string(h.vm), string(h.session)}
		}
		if h.hasIntent {
			delete(open, h.intent)
		}
		n++
	}
	if cp != nil && cp.Size > n {
		return &LostError{Checkpoint: cp.Size, Records: n} // and cut nothing
	}
	if end < recSize {
		if err := l.rec.Truncate(end); err != nil {
			return fmt.Errorf("truncate torn tail of %s: %w", recordsFile, err)
		}
		if err := l.rec.Sync(); err != nil {
			return fmt.Errorf("sync %s: %w", recordsFile, err)
		}
		l.rcv.TruncatedAt, l.rcv.TruncatedBytes = l.segBase+end, recSize-end
		l.log.Warn("cut torn tail of audit log", "offset", l.segBase+end, "bytes", recSize-end, "reason", l.rcv.TailReason, "records", n)
	}
	if err := l.flushHashes(); err != nil {
		return err
	}
	l.hashed.Store(n)
	l.offset, l.next = end, n
	l.size.Store(n)
	l.rcv.Records, l.rcv.HashesFrom = n, k
	if cp != nil {
		l.cpAsked, l.rcv.Checkpoint = cp.Size, cp.Size
		l.ckpt.latest, l.ckpt.want = cp, *cp
	}
	if n == l.segFirst && len(segs) > 0 {
		// Rolled, and stopped before records.log's first record was
		// durable: the intents open at the roll are the last segment's.
		last := segs[len(segs)-1]
		if last.path == "" {
			return fmt.Errorf("%s is empty and the segment before it, %s, is archived: restore it to %s to start the log again", recordsFile, last.name, segmentDir)
		}
		if open, err = intentsLeftOpen(l.dir, last, l.segBase-last.bytes); err != nil {
			return err
		}
		at, err := l.checkpointNow()
		if err != nil {
			return err
		}
		l.rolled = &rolled{seg: last, checkpoint: at.Note}
	}
	l.rcv.UnknownOutcomes = slices.Sorted(maps.Keys(open))
	l.openIntents = open
	return nil
}

// rehash adds one record to the tree, as recover rebuilds it, and checks
// the root where the checkpoint is.
func (l *Log) rehash(p []byte, cp *Checkpoint) error {
	l.hashFrame(p) // no readers yet: no hashMu
	if len(l.hashBuf) >= 1<<20 {
		if err := l.flushHashes(); err != nil {
			return err
		}
	}
	if cp != nil && l.tree.n == cp.Size {
		if root := l.tree.root(); root != cp.Root {
			return &CheckpointError{Size: cp.Size, Reason: fmt.Sprintf("the records hash to %s, the checkpoint says %s", root, cp.Root)}
		}
	}
	return nil
}

// rehashSegments rebuilds the stored hashes of records from..segFirst-1,
// which rotated segments hold: the rare case of a hashes.db that lags
// behind records.log.
func (l *Log) rehashSegments(segs []segment, from uint64, cp *Checkpoint) error {
	var base int64
	next := uint64(0)
	var h header
	for _, s := range segs {
		if s.first != next {
			return fmt.Errorf("rebuild %s: records %d to %d are in no segment", hashesFile, next, s.first-1)
		}
		next = s.last + 1
		if s.last < from {
			base += s.bytes
			continue
		}
		if s.path == "" {
			return fmt.Errorf("rebuild %s from record %d: segment %s is archived: restore it to %s (docs/audit.md, Segments and archiving)", hashesFile, from, s.name, segmentDir)
		}
		f, err := os.Open(s.path)
		if err != nil {
			return fmt.Errorf("rebuild %s: %w", hashesFile, err)
		}
		fr := newFrameReader(f, s.bytes)
		for seq := s.first; ; seq++ {
			p, off, err := fr.next()
			if err == io.EOF && seq == s.last+1 {
				break
			}
			if err == nil && parseHeader(p, &h) == nil && h.seq != seq {
				err = fmt.Errorf("the record there says seq %d", h.seq)
			}
			if err != nil {
				f.Close()
				if err == io.EOF {
					err = fmt.Errorf("segment %s ends after record %d", s.name, seq-1)
				}
				return &CorruptError{Offset: base + off, Seq: seq, Reason: err.Error()}
			}
			if seq >= from {
				if err := l.rehash(p, cp); err != nil {
					f.Close()
					return err
				}
			}
		}
		f.Close()
		base += s.bytes
	}
	return nil
}

// seedIntents adds the intents a segment's first record, an
// audit.segment, says were open at the roll.
func seedIntents(dir string, p []byte, h *header, open map[uint64]openIntent) error {
	if string(h.kind) != KindSegment {
		return fmt.Errorf("the first record of a segment after the first is %q, not %q", h.kind, KindSegment)
	}
	rec, err := Decode(p)
	if err != nil {
		return err
	}
	var d SegmentStart
	if err := json.Unmarshal(rec.Data, &d); err != nil {
		return fmt.Errorf("%s record: %w", KindSegment, err)
	}
	refs, err := d.intents(dir)
	if err != nil {
		return fmt.Errorf("%s record: %w", KindSegment, err)
	}
	for _, in := range refs {
		open[in.Seq] = openIntent{in.VM, in.Session}
	}
	return nil
}

// intentsLeftOpen reads a rotated segment of the log in dir, at offset
// base of the log, for the intents still open at its end.
func intentsLeftOpen(dir string, s segment, base int64) (map[uint64]openIntent, error) {
	f, err := os.Open(s.path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	open := map[uint64]openIntent{}
	fr := newFrameReader(f, s.bytes)
	var h header
	for seq := s.first; ; seq++ {
		p, off, err := fr.next()
		if err == io.EOF {
			return open, nil
		}
		if err == nil {
			err = parseHeader(p, &h)
		}
		if err == nil && seq == s.first && seq > 0 {
			err = seedIntents(dir, p, &h, open)
		}
		if err != nil {
			return nil, &CorruptError{Offset: base + off, Seq: seq, Reason: err.Error()}
		}
		if string(h.kind) == KindIntent {
			open[seq] = openIntent{string(h.vm), string(h.session)}
		}
		if h.hasIntent {
			delete(open, h.intent)
		}
	}
}

// hashFrame adds one record to the tree and queues its stored hashes.
func (l *Log) hashFrame(p []byte) {
	l.stored = l.tree.push(l.lh.sum(p), l.stored[:0])
	for _, h := range l.stored {
		l.hashBuf = append(l.hashBuf, h[:]...)
	}
}

// appendRecovery records, durably, what recover repaired: one
// audit.recovery record, then an "unknown" outcome for each open intent.
func (l *Log) appendRecovery() error {
	r := &l.rcv
	if r.TruncatedBytes == 0 && len(r.UnknownOutcomes) == 0 {
		return nil
	}
	d := RecoveryData{Cause: "restart", UnknownOutcomes: len(r.UnknownOutcomes)}
	if r.TruncatedBytes > 0 {
		d.TruncatedAt, d.TruncatedBytes, d.TailReason = &r.TruncatedAt, r.TruncatedBytes, r.TailReason
	}
	data, err := json.Marshal(d)
	if err != nil {
		return err
	}
	recs := []Record{{Kind: KindRecovery, Provenance: Host, Data: data}}
	unknown, err := json.Marshal(OutcomeData{Outcome: OutcomeUnknown, Reason: unknownReason})
	if err != nil {
		return err
	}
	for _, seq := range r.UnknownOutcomes {
		in := l.openIntents[seq]
		recs = append(recs, Record{Kind: KindOutcome, VM: in.vm, Session: in.session, Provenance: Host, Intent: &seq, Data: unknown})
	}
	for len(recs) > 0 {
		b := &batch{done: make(chan struct{})}
		for len(recs) > 0 && b.bytes < maxBatchBytes/2 {
			body, err := encodeBody(&recs[0])
			if err != nil {
				return err
			}
			r := &request{b: b}
			r.set(&recs[0], body)
			b.reqs = append(b.reqs, r)
			b.bytes += frameHeaderSize + maxPrefix + len(body)
			recs = recs[1:]
		}
		if err := l.commit(b); err != nil {
			return err
		}
		if err := l.Health(); err != nil {
			return err
		}
	}
	l.log.Info("audit log recovered", "records", r.Records, "truncated_bytes", r.TruncatedBytes, "unknown_outcomes", len(r.UnknownOutcomes))
	return nil
}

// tornTail says why the bad frame at off cannot be a torn tail, or ""
// when it can. A torn tail is part of the last write, the one batch not
// yet acknowledged: the committer writes a batch only once the one before
// is durable. So it is at most maxTornBytes long, and the good frames
// after the bad one, if any (the disk may persist a later page and lose an
// earlier one), all belong to that one batch and carry its one timestamp.
func tornTail(fr *frameReader, off int64) string {
	if rest := fr.size - off; rest > maxTornBytes {
		return fmt.Sprintf("with %d bytes after it: more than a torn write leaves", rest)
	}
	probe := newFrameReader(fr.r, fr.size)
	var batchTime string
	var h header
	for pos := off; ; {
		next, err := fr.resync(pos)
		if err != nil {
			return err.Error()
		}
		if next < 0 {
			return ""
		}
		probe.seek(next)
		for {
			p, o, err := probe.next()
			if err == io.EOF {
				return ""
			}
			if err != nil {
				pos = o
				break
			}
			if parseHeader(p, &h) != nil {
				return fmt.Sprintf("and the good frame at %d is not a record", o)
			}
			if batchTime == "" {
				batchTime = string(h.time)
			} else if string(h.time) != batchTime {
				return fmt.Sprintf("and good frames after it come from more than one commit (%s, %s): acknowledged records follow", batchTime, h.time)
			}
		}
	}
}
