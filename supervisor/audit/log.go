package audit

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/mod/sumdb/tlog"

	"github.com/carrel-os/carrel/supervisor/atomicfile"
)

// Options tune a Log. The zero value is the default.
type Options struct {
	// CheckpointEvery records a checkpoint is signed; default 1000.
	CheckpointEvery int
	// CheckpointInterval is how often a checkpoint is signed when there
	// are records since the last; default 5s.
	CheckpointInterval time.Duration
	// RetryInterval is how often an unavailable log probes the disk;
	// default 1s.
	RetryInterval time.Duration
	// Logger defaults to slog.Default(); records get subsystem=audit.
	Logger *slog.Logger
	// OnFault is called when the log turns unavailable, with an error
	// wrapping ErrUnavailable and the cause. OnRecover is called when it
	// is available again. Both run on the log's goroutines, one at a time,
	// and must not call the Log's methods that wait (Append, Begin, End,
	// Close).
	OnFault   func(error)
	OnRecover func()
	// Origin names a new log's key, and so its checkpoints' origin line
	// (default KeyName). Witnesses tell logs apart by it: give each host
	// its own (its name, say) before its log is first made. An existing
	// log's key decides; another Origin is an error.
	Origin string
	// OnCheckpoint is called with each checkpoint once it is written and
	// synced, on the log's goroutine: it must not block or call the Log's
	// methods that wait. carreld hands it to its witnesses.
	OnCheckpoint func(Checkpoint)
	// SegmentBytes and SegmentAge bound records.log: once it holds
	// SegmentBytes (default 128 MiB), or its first record is older than
	// SegmentAge (default 24h), it is rolled over between two group
	// commits into segments/ and a new records.log started (see
	// segment.go).
	SegmentBytes int64
	SegmentAge   time.Duration

	// Tests replace how files are opened and written, and the clock.
	open      openFunc
	writeFile func(string, []byte, os.FileMode) error
	now       func() time.Time
}

func (o *Options) setDefaults() {
	if o.CheckpointEvery <= 0 {
		o.CheckpointEvery = 1000
	}
	if o.CheckpointInterval <= 0 {
		o.CheckpointInterval = 5 * time.Second
	}
	if o.RetryInterval <= 0 {
		o.RetryInterval = time.Second
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	o.Logger = o.Logger.With("subsystem", "audit")
	if o.open == nil {
		o.open = openAppend
	}
	if o.writeFile == nil {
		o.writeFile = atomicfile.WriteFile
	}
	if o.SegmentBytes <= 0 {
		o.SegmentBytes = DefaultSegmentBytes
	}
	if o.SegmentAge <= 0 {
		o.SegmentAge = DefaultSegmentAge
	}
	if o.now == nil {
		o.now = time.Now
	}
}

const (
	recordsFile = "records.log"
	hashesFile  = "hashes.db"
	lockFile    = "lock"
)

// Log is an open audit log. Its methods are safe for concurrent use.
type Log struct {
	dir  string
	opts Options
	log  *slog.Logger
	vkey string
	lock *os.File
	rec  file
	hash file
	ckpt checkpointer
	rcv  Recovery

	// Owned by the committer goroutine (and by Open before it starts).
	offset      int64  // end of the last acknowledged frame in records.log
	next        uint64 // the next seq
	segFirst    uint64 // the seq of records.log's first record
	segBase     int64  // records.log's first byte's offset in the whole log
	segDeadline time.Time
	rollDue     bool    // records.log is full or old: roll it before the next batch
	rolled      *rolled // rolled out; records.log's first record is not written yet
	tree        *tree
	hashN       int64  // entries written to hashes.db
	hashBuf     []byte // stored hashes not yet written
	stored      []tlog.Hash
	lh          *leafHasher
	buf         []byte // the frames of the batch being committed
	ts          []byte
	cpAsked     uint64                // size of the last checkpoint asked for
	openIntents map[uint64]openIntent // intents without an outcome, by seq

	mu         sync.Mutex
	pending    []*batch
	closed     bool
	fault      error // the cause, while unavailable
	faultSince time.Time
	refused    uint64
	faults     uint64 // setFault calls, so that a probe sees one it did not make
	// deferred are the outcomes refused or failed while the log was
	// unavailable, written once it is available again (see probe).
	deferred []*request

	size     atomic.Uint64 // durable records
	commits  atomic.Uint64 // group commits made
	hashed   atomic.Uint64 // records whose stored hashes are in hashes.db or hashBuf
	hashMu   sync.Mutex    // hashN and hashBuf, for proofs read outside the committer
	hashCond sync.Cond     // on hashMu: hashed grew
	cbMu     sync.Mutex

	wake          chan struct{}
	stop          chan struct{}
	committerDone chan struct{}
	ckptDone      chan struct{}
}

// Open opens the log in dir, creating it (and its signing key) if needed,
// and recovers it: see the package documentation. Records that recovery
// appends (unknown outcomes, audit.recovery) are durable when Open
// returns. A log can be open in one process at a time.
func Open(dir string, opts Options) (*Log, error) {
	opts.setDefaults()
	dir, err := filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	for _, d := range []string{dir, filepath.Join(dir, checkpointDir), filepath.Join(dir, segmentDir), filepath.Join(dir, blobDir, "sha256")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("open audit log: %w", err)
		}
	}
	for _, d := range []string{dir, filepath.Join(dir, blobDir)} {
		if err := atomicfile.SyncDir(d); err != nil {
			return nil, fmt.Errorf("open audit log: %w", err)
		}
	}
	l := &Log{
		dir: dir, opts: opts, log: opts.Logger, lh: newLeafHasher(),
		wake: make(chan struct{}, 1), stop: make(chan struct{}),
		committerDone: make(chan struct{}), ckptDone: make(chan struct{}),
	}
	l.hashCond.L = &l.hashMu
	if err := l.openFiles(); err != nil {
		l.closeFiles()
		return nil, err
	}
	if err := l.recover(); err != nil {
		l.closeFiles()
		return nil, fmt.Errorf("recover audit log %s: %w", dir, err)
	}
	if l.rolled != nil { // a crash came between a roll's rename and records.log's first record
		if err := l.startSegment(); err != nil {
			l.closeFiles()
			return nil, fmt.Errorf("recover audit log %s: %w", dir, err)
		}
	}
	if err := l.appendRecovery(); err != nil {
		l.closeFiles()
		return nil, fmt.Errorf("recover audit log %s: %w", dir, err)
	}
	l.askCheckpoint() // cover what a crash left unsigned
	go l.run()
	go l.runCheckpointer()
	return l, nil
}

func (l *Log) openFiles() error {
	f, err := os.OpenFile(filepath.Join(l.dir, lockFile), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("open audit log: %w", err)
	}
	l.lock = f
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return fmt.Errorf("open audit log %s: %w", l.dir, ErrLocked)
		}
		return fmt.Errorf("lock audit log %s: %w", l.dir, err)
	}
	// A crash while a blob is written (PutBlob, CreateBlob) leaves its
	// temporary file behind.
	if left, _ := filepath.Glob(filepath.Join(l.dir, blobDir, blobTemp)); len(left) > 0 {
		for _, f := range left {
			os.Remove(f)
		}
	}
	origin := l.opts.Origin
	if origin == "" {
		origin = KeyName
	}
	signer, vkey, err := loadKey(l.dir, origin)
	if err != nil {
		return err
	}
	l.vkey = vkey
	if l.rec, err = l.opts.open(filepath.Join(l.dir, recordsFile)); err != nil {
		return fmt.Errorf("open audit log: %w", err)
	}
	if l.hash, err = l.opts.open(filepath.Join(l.dir, hashesFile)); err != nil {
		return fmt.Errorf("open audit log: %w", err)
	}
	l.ckpt = checkpointer{dir: l.dir, signer: signer, hashes: l.hash, writeFile: l.opts.writeFile, kick: make(chan struct{}, 1), written: l.opts.OnCheckpoint, logger: l.opts.Logger}
	return nil
}

func (l *Log) closeFiles() error {
	var errs []error
	for _, f := range []file{l.rec, l.hash} {
		if f != nil {
			errs = append(errs, f.Close())
		}
	}
	if l.lock != nil {
		errs = append(errs, l.lock.Close()) // releases the flock
	}
	return errors.Join(errs...)
}

// Close commits what is queued, signs a last checkpoint and closes the
// files. Appends after Close fail with ErrClosed.
func (l *Log) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return ErrClosed
	}
	l.closed = true
	l.mu.Unlock()
	close(l.stop)
	<-l.committerDone
	<-l.ckptDone
	l.mu.Lock()
	lost := len(l.deferred)
	l.deferred = nil
	l.mu.Unlock()
	if lost > 0 {
		l.log.Error("audit log closed while unavailable: outcomes kept for it are lost; the next start marks their intents unknown", "outcomes", lost)
	}
	var errs []error
	if l.Health() == nil {
		errs = append(errs, l.ckpt.flush())
	} else {
		errs = append(errs, l.Health())
	}
	errs = append(errs, l.hash.Sync(), l.closeFiles())
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("close audit log %s: %w", l.dir, err)
	}
	return nil
}

// Append makes rec durable and returns its seq. It sets rec's Seq and
// Time. Any blobs rec references must have been stored (PutBlob, or
// CreateBlob and a commit). If ctx ends first, Append returns ctx's error
// and the record may or may not be written.
func (l *Log) Append(ctx context.Context, rec Record) (uint64, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	reqs := make([]request, 1)
	if err := l.encode(&rec, &reqs[0]); err != nil {
		return 0, err
	}
	if err := l.enqueue(reqs); err != nil {
		return 0, err
	}
	return wait(ctx, &reqs[0])
}

// AppendAll makes recs durable, in order, and returns their seqs. They are
// queued together, so they share one group commit (one write, one
// fdatasync) unless they are too large for one batch. Either all are
// durable or AppendAll fails; after a failure, a prefix of them may be.
func (l *Log) AppendAll(ctx context.Context, recs ...Record) ([]uint64, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	reqs := make([]request, len(recs)) // one allocation for the group
	for i := range recs {
		if err := l.encode(&recs[i], &reqs[i]); err != nil {
			return nil, err
		}
	}
	if err := l.enqueue(reqs); err != nil {
		return nil, err
	}
	seqs := make([]uint64, len(reqs))
	for i := range reqs {
		var err error
		if seqs[i], err = wait(ctx, &reqs[i]); err != nil {
			return nil, err
		}
	}
	return seqs, nil
}

// encode checks rec and fills r with its body.
func (l *Log) encode(rec *Record, r *request) error {
	if rec.Intent != nil && *rec.Intent >= l.size.Load() {
		return fmt.Errorf("%w: intent %d is not in the log", ErrInvalid, *rec.Intent)
	}
	body, err := encodeBody(rec)
	if err != nil {
		return err
	}
	for _, d := range rec.Blobs {
		if _, err := os.Stat(blobPath(l.dir, d)); err != nil {
			return fmt.Errorf("%w: blob %s: %v", ErrInvalid, d, err)
		}
	}
	r.set(rec, body)
	return nil
}

// wait returns r's seq once its batch is durable, or why it is not.
func wait(ctx context.Context, r *request) (uint64, error) {
	select {
	case <-r.b.done:
	case <-ctx.Done():
		return 0, fmt.Errorf("audit append: %w (the record may still be written)", ctx.Err())
	}
	if r.b.err != nil {
		return 0, r.b.err
	}
	return r.seq, nil
}

// Commits is how many group commits (each one write and one fdatasync of
// the records file) the log has made since it was opened.
func (l *Log) Commits() uint64 { return l.commits.Load() }

// Health returns nil while the log can make records durable, and
// otherwise an error wrapping ErrUnavailable and the cause.
func (l *Log) Health() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.fault != nil {
		return unavailable(l.fault)
	}
	return nil
}

func unavailable(cause error) error { return fmt.Errorf("%w: %w", ErrUnavailable, cause) }

// Size is the number of durable records.
func (l *Log) Size() uint64 { return l.size.Load() }

// Dir is the log's directory.
func (l *Log) Dir() string { return l.dir }

// PublicKey is the verifier key that checks the log's checkpoints.
func (l *Log) PublicKey() string { return l.vkey }

// Checkpoint is the latest checkpoint written, or nil before the first.
func (l *Log) Checkpoint() *Checkpoint { return l.ckpt.current() }

// Recovered says what Open had to repair.
func (l *Log) Recovered() Recovery { return l.rcv }

// Pending is an action whose intent is durable and whose outcome is not
// yet recorded.
type Pending struct {
	l           *Log
	seq         uint64
	vm, session string
	ended       atomic.Bool
}

// Begin appends an "action.intent" record (rec.Kind empty or KindIntent)
// and returns once it is durable: only then may the action run.
func (l *Log) Begin(ctx context.Context, rec Record) (*Pending, error) {
	return l.BeginAfter(ctx, nil, rec)
}

// BeginAfter is Begin with the records that admit the action (its policy
// decisions, say) appended just before the intent, in the same group
// commit: one fdatasync makes them all durable.
func (l *Log) BeginAfter(ctx context.Context, before []Record, rec Record) (*Pending, error) {
	if rec.Kind == "" {
		rec.Kind = KindIntent
	}
	if rec.Kind != KindIntent || rec.Intent != nil {
		return nil, fmt.Errorf("%w: an intent has kind %q and no intent field", ErrInvalid, KindIntent)
	}
	seqs, err := l.AppendAll(ctx, append(before[:len(before):len(before)], rec)...)
	if err != nil {
		return nil, err
	}
	return &Pending{l: l, seq: seqs[len(seqs)-1], vm: rec.VM, session: rec.Session}, nil
}

// Seq is the intent record's seq.
func (p *Pending) Seq() uint64 { return p.seq }

// End appends the action's outcome: rec with Intent set to the intent's
// seq, Kind defaulting to "action.outcome", and VM and Session to the
// intent's. A failed End may be retried (after a ctx error the outcome
// may already be written, and Verify would then report two); a second
// successful one is ErrEnded. One that fails because the log is
// unavailable is not to be retried: the log keeps the outcome and writes
// it when it is available again (ErrUnavailable, and End is ErrEnded).
func (p *Pending) End(ctx context.Context, rec Record) (uint64, error) {
	if !p.ended.CompareAndSwap(false, true) {
		return 0, ErrEnded
	}
	s, err := p.l.Append(ctx, p.Outcome(rec))
	if err != nil && !errors.Is(err, ErrUnavailable) {
		p.ended.Store(false)
	}
	return s, err
}

// Outcome is rec as End would append it, for a caller that appends the
// outcome with other records (AppendAll). It does not end p.
func (p *Pending) Outcome(rec Record) Record {
	if rec.Kind == "" {
		rec.Kind = KindOutcome
	}
	if rec.VM == "" {
		rec.VM = p.vm
	}
	if rec.Session == "" {
		rec.Session = p.session
	}
	seq := p.seq
	rec.Intent = &seq
	return rec
}
