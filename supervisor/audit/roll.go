package audit

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"

	"github.com/carrel-os/carrel/supervisor/atomicfile"
)

// rolled is a segment rolled out of records.log, and the signed
// checkpoint at its end, until the new records.log's first record names
// them.
type rolled struct {
	seg        segment
	checkpoint []byte
}

// roll rolls records.log over, on the committer's goroutine between two
// batches, once it holds more than its first record: it signs the
// checkpoint at its end (written and synced), renames it, whole, into
// segments/, and starts a new records.log whose first record is an
// "audit.segment" that commits to it. A failure makes the log
// unavailable; a roll that got as far as the rename is finished by the
// probe, or by Open after a crash.
func (l *Log) roll() {
	l.rollDue = false
	if l.next-l.segFirst < 2 {
		return
	}
	cp, err := l.checkpointNow()
	if err != nil {
		l.setFault(err)
		return
	}
	if err := l.rec.Sync(); err != nil {
		l.setFault(fmt.Errorf("sync %s: %w", recordsFile, err))
		return
	}
	seg := segment{name: segmentName(l.segFirst, l.next-1), first: l.segFirst, last: l.next - 1, bytes: l.offset}
	if err := os.Rename(filepath.Join(l.dir, recordsFile), filepath.Join(l.dir, segmentDir, seg.name)); err != nil {
		l.setFault(fmt.Errorf("roll %s over: %w", recordsFile, err))
		return
	}
	if err := os.Chmod(filepath.Join(l.dir, segmentDir, seg.name), 0o400); err != nil {
		l.log.Warn("make a rolled segment read-only", "segment", seg.name, "err", err)
	}
	if err := l.rec.Close(); err != nil {
		l.log.Warn("close a rolled segment", "segment", seg.name, "err", err)
	}
	l.rec = nil
	l.rolled = &rolled{seg: seg, checkpoint: cp.Note}
	if err := l.startSegment(); err == nil {
		l.log.Info("audit log rolled over", "segment", seg.name, "bytes", seg.bytes)
	}
}

// checkpointNow signs the checkpoint of every record so far, and returns
// it once it is written and synced.
func (l *Log) checkpointNow() (*Checkpoint, error) {
	if err := l.flushHashes(); err != nil {
		return nil, err
	}
	l.cpAsked = max(l.cpAsked, l.tree.n)
	l.ckpt.request(l.tree.n, l.tree.root())
	if err := l.ckpt.flush(); err != nil {
		return nil, err
	}
	cp := l.ckpt.current()
	if cp == nil || cp.Size != l.tree.n {
		return nil, fmt.Errorf("checkpoint %d: not written", l.tree.n)
	}
	return cp, nil
}

// startSegment makes the rolled segment's successor: records.log,
// created if a roll renamed it away, whose first record, durable before
// any other is written there, is the audit.segment record. On failure the
// log is unavailable, and the probe tries again.
func (l *Log) startSegment() error {
	r := l.rolled
	if l.rec == nil {
		for _, d := range []string{filepath.Join(l.dir, segmentDir), l.dir} {
			if err := atomicfile.SyncDir(d); err != nil {
				l.setFault(fmt.Errorf("roll %s over: %w", recordsFile, err))
				return err
			}
		}
		f, err := l.opts.open(filepath.Join(l.dir, recordsFile))
		if err != nil {
			l.setFault(fmt.Errorf("roll %s over: %w", recordsFile, err))
			return err
		}
		l.rec = f
		l.segBase += r.seg.bytes
		l.segFirst, l.offset = l.next, 0
	}
	start := SegmentStart{Previous: r.seg.name, Records: r.seg.records(), Bytes: r.seg.bytes, Checkpoint: string(r.checkpoint)}
	rec := Record{Kind: KindSegment, Provenance: Host}
	if err := start.setIntents(l.dir, l.intentRefs()); err != nil {
		l.setFault(fmt.Errorf("start segment after %s: %w", r.seg.name, err))
		return err
	}
	if start.OpenIntentsBlob != "" {
		rec.Blobs = []string{start.OpenIntentsBlob}
	}
	data, err := json.Marshal(start)
	if err != nil {
		return err
	}
	rec.Data = data
	body, err := encodeLarge(&rec)
	if err != nil {
		l.setFault(fmt.Errorf("start segment after %s: %w", r.seg.name, err))
		return err
	}
	if err := l.commitOne(body); err != nil {
		return err // commit set the fault
	}
	l.rolled = nil
	return nil
}

// intentRefs are the open intents, by seq.
func (l *Log) intentRefs() []IntentRef {
	out := make([]IntentRef, 0, len(l.openIntents))
	for _, seq := range slices.Sorted(maps.Keys(l.openIntents)) {
		in := l.openIntents[seq]
		out = append(out, IntentRef{Seq: seq, VM: in.vm, Session: in.session})
	}
	return out
}

// inlineIntents is how many open intents an audit.segment record lists
// itself; more go to a blob (about 100 bytes each).
const inlineIntents = 1000

// setIntents puts the open intents in d, or in a blob of the log in dir
// that d names when there are more than inlineIntents.
func (d *SegmentStart) setIntents(dir string, refs []IntentRef) error {
	if len(refs) <= inlineIntents {
		d.OpenIntents = refs
		return nil
	}
	b, err := json.Marshal(refs)
	if err != nil {
		return err
	}
	digest, err := putBlob(dir, bytes.NewReader(b))
	if err != nil {
		return err
	}
	d.OpenIntents, d.OpenIntentsBlob, d.OpenIntentsCount = []IntentRef{}, digest, len(refs)
	return nil
}

// maxIntentsBlob bounds the blob of open intents that recovery and
// verification read.
const maxIntentsBlob = 1 << 30

// intents are the open intents d lists, itself or in its blob in the log
// in dir.
func (d *SegmentStart) intents(dir string) ([]IntentRef, error) {
	if d.OpenIntentsBlob == "" {
		return d.OpenIntents, nil
	}
	p, err := BlobPath(dir, d.OpenIntentsBlob)
	if err != nil {
		return nil, err
	}
	f, err := os.Open(p)
	if err != nil {
		return nil, fmt.Errorf("the open intents' blob: %w", err)
	}
	defer f.Close()
	var refs []IntentRef
	if err := json.NewDecoder(io.LimitReader(f, maxIntentsBlob)).Decode(&refs); err != nil {
		return nil, fmt.Errorf("the open intents' blob %s: %w", d.OpenIntentsBlob, err)
	}
	if len(refs) != d.OpenIntentsCount {
		return nil, fmt.Errorf("the open intents' blob %s lists %d intents, the record says %d", d.OpenIntentsBlob, len(refs), d.OpenIntentsCount)
	}
	return refs, nil
}
