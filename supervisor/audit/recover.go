package audit

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"

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
// starts: see the package documentation.
func (l *Log) recover() error {
	v, err := note.NewVerifier(l.vkey)
	if err != nil {
		return err
	}
	cp, err := latestCheckpoint(l.dir, note.VerifierList(v))
	if err != nil {
		return err
	}
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

	fr := newFrameReader(l.rec, recSize)
	var h header
	open := map[uint64]openIntent{}
	var n uint64
	end := recSize
	for {
		p, off, err := fr.next()
		if err == io.EOF {
			break
		}
		var fe *frameError
		if errors.As(err, &fe) {
			if why := tornTail(fr, off); why != "" {
				return &CorruptError{Offset: off, Seq: n, Reason: fe.reason + ", " + why}
			}
			end, l.rcv.TailReason = off, fe.reason
			break
		}
		if err != nil {
			return err
		}
		if err := parseHeader(p, &h); err != nil {
			return &CorruptError{Offset: off, Seq: n, Reason: err.Error()}
		}
		if h.seq != n {
			return &CorruptError{Offset: off, Seq: n, Reason: fmt.Sprintf("the record there says seq %d", h.seq)}
		}
		if n >= k {
			l.hashFrame(p) // no readers yet: no hashMu
			if len(l.hashBuf) >= 1<<20 {
				if err := l.flushHashes(); err != nil {
					return err
				}
			}
			if cp != nil && t.n == cp.Size {
				if root := t.root(); root != cp.Root {
					return &CheckpointError{Size: cp.Size, Reason: fmt.Sprintf("the records hash to %s, the checkpoint says %s", root, cp.Root)}
				}
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
		l.rcv.TruncatedAt, l.rcv.TruncatedBytes = end, recSize-end
		l.log.Warn("cut torn tail of audit log", "offset", end, "bytes", recSize-end, "reason", l.rcv.TailReason, "records", n)
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
	l.rcv.UnknownOutcomes = slices.Sorted(maps.Keys(open))
	l.openIntents = open
	return nil
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
	l.openIntents = nil
	for len(recs) > 0 {
		b := &batch{done: make(chan struct{})}
		for len(recs) > 0 && b.bytes < maxBatchBytes/2 {
			body, err := encodeBody(&recs[0])
			if err != nil {
				return err
			}
			b.reqs = append(b.reqs, &request{body: body, b: b})
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
