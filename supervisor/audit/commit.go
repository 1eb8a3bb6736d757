package audit

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"time"

	"golang.org/x/mod/sumdb/tlog"
)

// request is one queued record: its body, and the seq it got. An intent
// (opens) or an outcome (ends) changes the log's open intents once it is
// durable.
type request struct {
	body        []byte
	seq         uint64
	b           *batch
	opens       bool
	ends        *uint64
	vm, session string
}

// set fills r for rec, whose body is body.
func (r *request) set(rec *Record, body []byte) {
	r.body = body
	r.opens = rec.Kind == KindIntent && rec.Intent == nil
	r.ends = rec.Intent
	if r.opens {
		r.vm, r.session = rec.VM, rec.Session
	}
}

// batch is one group commit: one write and one fdatasync. Its waiters
// wake together when done is closed; err is set before.
type batch struct {
	reqs  []*request
	bytes int
	done  chan struct{}
	err   error
}

// enqueue queues requests for the committer, all under one lock, so
// that they share a group commit where they fit in one batch. It fails
// fast, queueing none, while the log is closed or unavailable.
func (l *Log) enqueue(reqs []request) error {
	l.mu.Lock()
	switch {
	case l.closed:
		l.mu.Unlock()
		return ErrClosed
	case l.fault != nil:
		l.refused++
		err := unavailable(l.fault)
		for i := range reqs {
			l.deferLocked(&reqs[i])
		}
		l.mu.Unlock()
		return err
	}
	for i := range reqs {
		r := &reqs[i]
		size := frameHeaderSize + maxPrefix + len(r.body)
		var b *batch
		if k := len(l.pending); k > 0 && l.pending[k-1].bytes+size <= maxBatchBytes {
			b = l.pending[k-1]
		} else {
			b = &batch{done: make(chan struct{})}
			l.pending = append(l.pending, b)
		}
		b.reqs = append(b.reqs, r)
		b.bytes += size
		r.b = b
	}
	l.mu.Unlock()
	l.kick()
	return nil
}

// kick wakes the committer if it is waiting.
func (l *Log) kick() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

func (l *Log) take() *batch {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.pending) == 0 {
		return nil
	}
	b := l.pending[0]
	l.pending[0] = nil
	l.pending = l.pending[1:]
	return b
}

func (l *Log) faulted() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.fault != nil
}

// run is the committer: it commits one batch at a time, hashes what is
// durable and asks for checkpoints; while the log is unavailable it
// probes the disk every RetryInterval instead.
func (l *Log) run() {
	defer close(l.committerDone)
	tick := time.NewTicker(l.opts.CheckpointInterval)
	defer tick.Stop()
	stop := l.stop
	stopping := false
	for {
		if l.faulted() {
			if stopping {
				l.failPending(ErrClosed)
				return
			}
			select {
			case <-time.After(l.opts.RetryInterval):
				l.probe()
			case <-stop:
				stopping, stop = true, nil
			}
			continue
		}
		if b := l.take(); b != nil {
			l.commit(b)
			if l.rollDue {
				l.roll()
			}
			continue
		}
		if stopping {
			l.maybeCheckpoint(true)
			return
		}
		select {
		case <-l.wake:
		case <-tick.C:
			l.maybeCheckpoint(true)
			if l.offset > 0 && l.opts.now().After(l.segDeadline) {
				l.roll()
			}
		case <-stop:
			stopping, stop = true, nil
		}
	}
}

// commit writes a batch with one write, makes it durable with one
// fdatasync, wakes its waiters, and then hashes it. All records of a
// batch get one time. Only one batch is ever written and not yet
// acknowledged: that bounds a torn tail (see tornTail).
func (l *Log) commit(b *batch) error {
	now := l.opts.now()
	l.ts = now.UTC().AppendFormat(l.ts[:0], time.RFC3339Nano)
	buf := l.buf[:0]
	seq := l.next
	for _, r := range b.reqs {
		start := len(buf)
		buf = append(buf, 0, 0, 0, 0, 0, 0, 0, 0)
		buf = appendPayload(buf, seq, l.ts, r.body)
		putFrameHeader(buf[start:start+frameHeaderSize], buf[start+frameHeaderSize:])
		r.seq = seq
		seq++
	}
	if cap(buf) <= 2*maxBatchBytes {
		l.buf = buf
	}
	n, err := l.rec.Write(buf)
	switch {
	case err != nil:
		err = fmt.Errorf("append to %s: %w", recordsFile, err)
	case n != len(buf):
		err = fmt.Errorf("append to %s: %w", recordsFile, io.ErrShortWrite)
	default:
		if err = l.rec.Sync(); err != nil {
			err = fmt.Errorf("sync %s: %w", recordsFile, err)
		}
	}
	if err != nil {
		// Leave no partial frame behind; if this fails too, the probe
		// truncates before it writes anything.
		if terr := l.rec.Truncate(l.offset); terr != nil {
			l.log.Error("truncate after failed append", "offset", l.offset, "err", terr)
		}
		b.err = unavailable(err)
		close(b.done)
		l.mu.Lock()
		for _, r := range b.reqs {
			l.deferLocked(r)
		}
		l.mu.Unlock()
		l.setFault(err)
		return err
	}
	if l.offset == 0 {
		l.segDeadline = now.Add(l.opts.SegmentAge)
	}
	l.offset += int64(len(buf))
	l.next = seq
	l.size.Store(seq)
	l.commits.Add(1)
	close(b.done)
	for _, r := range b.reqs {
		switch {
		case r.opens:
			l.openIntents[r.seq] = openIntent{r.vm, r.session}
		case r.ends != nil:
			delete(l.openIntents, *r.ends)
		}
	}
	l.rollDue = l.offset >= l.opts.SegmentBytes || now.After(l.segDeadline)

	l.hashFrames(buf)
	l.maybeCheckpoint(false)
	if len(l.hashBuf) >= hashFlushBytes {
		if err := l.flushHashes(); err != nil {
			l.setFault(err) // the batch is durable all the same
		}
	}
	return nil
}

// hashFrames adds the batch's records to the tree and queues their
// stored hashes.
func (l *Log) hashFrames(buf []byte) {
	l.hashMu.Lock()
	defer l.hashMu.Unlock()
	for off := 0; off < len(buf); {
		n := int(binary.LittleEndian.Uint32(buf[off:]))
		l.hashFrame(buf[off+frameHeaderSize : off+frameHeaderSize+n])
		off += frameHeaderSize + n
	}
	l.hashed.Store(l.tree.n)
	l.hashCond.Broadcast()
}

// hashFlushBytes of stored hashes are written at once, or fewer when a
// checkpoint needs them: every write to hashes.db would otherwise ride
// on the next fdatasync of records.log (ext4 orders data before the
// metadata that exposes it).
const hashFlushBytes = 64 << 10

// flushHashes appends the queued stored hashes to hashes.db, without
// fsync: hashes.db is synced before each checkpoint and rebuilt from
// records.log after a crash.
func (l *Log) flushHashes() error {
	l.hashMu.Lock()
	defer l.hashMu.Unlock()
	if len(l.hashBuf) == 0 {
		return nil
	}
	n, err := l.hash.Write(l.hashBuf)
	if err == nil && n != len(l.hashBuf) {
		err = io.ErrShortWrite
	}
	if err != nil {
		if terr := l.hash.Truncate(l.hashN * tlog.HashSize); terr != nil {
			l.log.Error("truncate hashes.db after failed write", "err", terr)
		}
		return fmt.Errorf("append to %s: %w", hashesFile, err)
	}
	l.hashN += int64(len(l.hashBuf) / tlog.HashSize)
	l.hashBuf = l.hashBuf[:0]
	return nil
}

// maybeCheckpoint asks for a checkpoint when CheckpointEvery records have
// come since the last, or, on the timer, when any have.
func (l *Log) maybeCheckpoint(timer bool) {
	if n := l.tree.n; n > l.cpAsked && (timer || n-l.cpAsked >= uint64(l.opts.CheckpointEvery)) {
		l.askCheckpoint()
	}
}

// askCheckpoint writes the hashes a checkpoint covers, then asks the
// checkpointer to sign it.
func (l *Log) askCheckpoint() {
	if l.tree.n <= l.cpAsked {
		return
	}
	if err := l.flushHashes(); err != nil {
		l.setFault(err)
		return
	}
	l.cpAsked = l.tree.n
	l.ckpt.request(l.tree.n, l.tree.root())
}

func (l *Log) runCheckpointer() {
	defer close(l.ckptDone)
	for {
		select {
		case <-l.ckpt.kick:
			if err := l.ckpt.flush(); err != nil {
				l.setFault(err)
			}
			l.ckpt.packIfDue()
		case <-l.committerDone:
			return // Close writes the last one
		}
	}
}

// setFault makes the log unavailable (or updates the cause): queued
// appends fail, later ones fail fast, and OnFault hears of it once.
func (l *Log) setFault(cause error) {
	l.mu.Lock()
	first := l.fault == nil
	if first {
		l.faultSince = time.Now()
		l.refused = 0
	}
	l.fault = cause
	l.faults++
	pend := l.pending
	l.pending = nil
	for _, b := range pend {
		for _, r := range b.reqs {
			l.deferLocked(r)
		}
	}
	l.mu.Unlock()
	for _, b := range pend {
		b.err = unavailable(cause)
		close(b.done)
	}
	// The checkpointer sets faults too, while the committer may be
	// waiting for appends that now fail fast: wake it to start probing.
	l.kick()
	if first {
		l.log.Error("audit log unavailable: admitting no actions", "err", cause)
		if l.opts.OnFault != nil {
			l.cbMu.Lock()
			l.opts.OnFault(unavailable(cause))
			l.cbMu.Unlock()
		}
	} else {
		l.log.Warn("audit log still unavailable", "err", cause)
	}
}

func (l *Log) failPending(err error) {
	l.mu.Lock()
	pend := l.pending
	l.pending = nil
	l.mu.Unlock()
	for _, b := range pend {
		b.err = err
		close(b.done)
	}
}

// probe retries what failed: the records file back to its last durable
// frame, the hashes not yet written, the checkpoint not yet signed, and
// then, as the test that writing works, an audit.recovery record saying
// how long the log was unavailable. Only when that record is durable does
// the log take appends again.
func (l *Log) probe() {
	l.mu.Lock()
	faults := l.faults
	l.mu.Unlock()
	fail := func(err error) { l.setFault(err) }
	if l.rec != nil { // nil during a roll that failed to start records.log again
		if err := l.rec.Truncate(l.offset); err != nil {
			fail(fmt.Errorf("truncate %s: %w", recordsFile, err))
			return
		}
	}
	if err := l.hash.Truncate(l.hashN * tlog.HashSize); err != nil {
		fail(fmt.Errorf("truncate %s: %w", hashesFile, err))
		return
	}
	if err := l.flushHashes(); err != nil {
		fail(err)
		return
	}
	l.maybeCheckpoint(false)
	if err := l.ckpt.flush(); err != nil {
		fail(err)
		return
	}
	if l.rolled != nil {
		if err := l.startSegment(); err != nil {
			return // the new cause is set
		}
	}
	l.mu.Lock()
	cause, since, refused := l.fault, l.faultSince, l.refused
	l.mu.Unlock()
	data, _ := json.Marshal(RecoveryData{Cause: "fault", Error: cause.Error(), Since: &since, Refused: refused})
	body, err := encodeBody(&Record{Kind: KindRecovery, Provenance: Host, Data: data})
	if err != nil {
		fail(err)
		return
	}
	if err := l.commitOne(body); err != nil {
		return // the new cause is set
	}
	if err := l.flushHashes(); err != nil {
		fail(err)
		return
	}
	// The outcomes kept meanwhile go next, until none is left: one kept
	// while the last were written is refused by a log still unavailable,
	// and is written too before the fault is cleared, in the same
	// critical section that finds none left.
	for {
		l.mu.Lock()
		if len(l.deferred) == 0 {
			if l.faults != faults {
				// A fault set since this probe began (by the checkpointer,
				// or by a commit above whose hashes failed) stands.
				l.mu.Unlock()
				return
			}
			l.fault = nil
			refused = l.refused
			l.mu.Unlock()
			break
		}
		l.mu.Unlock()
		if err := l.commitDeferred(); err != nil {
			return // the new cause is set
		}
		if err := l.flushHashes(); err != nil {
			fail(err)
			return
		}
	}
	l.log.Info("audit log available again", "since", since, "refused", refused)
	if l.opts.OnRecover != nil {
		l.cbMu.Lock()
		l.opts.OnRecover()
		l.cbMu.Unlock()
	}
}

// deferLocked keeps r if it is an outcome, for commitDeferred: an action
// that ended while the log could not say so has ended all the same, and
// its intent should not stay open until the next start marks it unknown.
// l.mu is held.
func (l *Log) deferLocked(r *request) {
	if r.ends != nil {
		l.deferred = append(l.deferred, &request{body: r.body, ends: r.ends})
	}
}

// commitDeferred writes the outcomes kept while the log was unavailable,
// in one batch, right after the probe's audit.recovery record: each at
// most once, and only for an intent still open. They carry the time they
// are written. A failure sets the fault again, and keeps them for the
// next probe.
func (l *Log) commitDeferred() error {
	l.mu.Lock()
	reqs := l.deferred
	l.deferred = nil
	l.mu.Unlock()
	b := &batch{done: make(chan struct{})}
	seen := map[uint64]bool{}
	for _, r := range reqs {
		if _, open := l.openIntents[*r.ends]; !open || seen[*r.ends] {
			continue
		}
		seen[*r.ends] = true
		r.b = b
		b.reqs = append(b.reqs, r)
	}
	if len(b.reqs) == 0 {
		return nil
	}
	if err := l.commit(b); err != nil {
		return err
	}
	l.log.Info("audit log wrote the outcomes that came while it was unavailable", "outcomes", len(b.reqs))
	return nil
}

// commitOne commits one record of the log's own, on the committer's
// goroutine (or Open's).
func (l *Log) commitOne(body []byte) error {
	b := &batch{done: make(chan struct{})}
	b.reqs = []*request{{body: body, b: b}}
	return l.commit(b)
}
