package witness

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"

	"github.com/carrel-os/carrel/supervisor/atomicfile"
	"github.com/carrel-os/carrel/supervisor/audit"
)

// Retry bounds: a failing witness is tried again after minRetry, doubling
// to maxRetry.
const (
	minRetry = 2 * time.Second
	maxRetry = 5 * time.Minute
)

// Target is a witness a log's checkpoints go to.
type Target struct {
	Client *Client
}

// Event is a change in a witness's state, for the audit log: it started
// failing (Err set), or cosigns again. carreld records these, not each
// cosignature: a record per cosignature would make a checkpoint of its
// own, forever.
type Event struct {
	Witness string
	// Size is the checkpoint it failed on, or cosigned.
	Size uint64
	Err  error
	// Refused: the witness refused the checkpoint itself (it does not
	// extend what the witness saw), not a failure to reach it.
	Refused bool
}

// Pusher shows each new checkpoint of an audit log to the witnesses, with
// the consistency proof from the last checkpoint each cosigned, and adds
// their cosignatures to the checkpoint's file. It never holds the log up:
// a witness that is down, slow or refusing is retried with backoff while
// the log goes on, and `carrel audit verify --witness` says which
// checkpoints lack cosignatures.
type Pusher struct {
	// Dir is the audit log's directory.
	Dir string
	// LogKey is the log's verifier key.
	LogKey note.Verifier
	// Proof proves the tree of size old a prefix of the tree of size new
	// (audit.Log.ConsistencyProof).
	Proof     func(old, size uint64) (tlog.TreeProof, error)
	Witnesses []Target
	// Record is told of each Event; nil records nothing.
	Record func(context.Context, Event)
	Logger *slog.Logger

	mu     sync.Mutex
	latest audit.Checkpoint
	kick   chan struct{}
}

// Checkpoint hands the pusher a new checkpoint (audit.Options.OnCheckpoint):
// it returns at once.
func (p *Pusher) Checkpoint(cp audit.Checkpoint) {
	p.mu.Lock()
	if cp.Size > p.latest.Size {
		p.latest = cp
	}
	kick := p.kick
	p.mu.Unlock()
	if kick != nil {
		select {
		case kick <- struct{}{}:
		default:
		}
	}
}

// witnessState is one witness's progress.
type witnessState struct {
	t       Target
	acked   uint64 // the largest checkpoint it cosigned
	failing error  // its last failure, until it cosigns again
	wait    time.Duration
	next    time.Time
}

// Run pushes checkpoints until ctx ends.
func (p *Pusher) Run(ctx context.Context) {
	if p.Logger == nil {
		p.Logger = slog.Default()
	}
	p.mu.Lock()
	if p.kick == nil {
		p.kick = make(chan struct{}, 1)
	}
	p.mu.Unlock()
	ws := make([]*witnessState, len(p.Witnesses))
	for i, t := range p.Witnesses {
		ws[i] = &witnessState{t: t, acked: p.loadAcked(t.Client.Key.Name())}
	}
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-p.kick:
		case <-timer.C:
		}
		p.mu.Lock()
		cp := p.latest
		p.mu.Unlock()
		soonest := time.Duration(0)
		for _, w := range ws {
			if cp.Size > w.acked && !time.Now().Before(w.next) {
				p.push(ctx, w, cp)
			}
			if cp.Size > w.acked && w.failing != nil {
				if d := time.Until(w.next); soonest == 0 || d < soonest {
					soonest = max(d, time.Millisecond)
				}
			}
		}
		if soonest > 0 {
			timer.Reset(soonest)
		}
	}
}

// push shows cp to one witness, once more from the witness's own size if
// it says it is elsewhere.
func (p *Pusher) push(ctx context.Context, w *witnessState, cp audit.Checkpoint) {
	name := w.t.Client.Key.Name()
	err := p.try(ctx, w, cp)
	var conflict *ConflictError
	if errors.As(err, &conflict) && conflict.Size != w.acked && conflict.Size < cp.Size {
		p.Logger.Info("witness is at another size; proving from there", "witness", name, "ours", w.acked, "its", conflict.Size)
		w.acked = conflict.Size
		err = p.try(ctx, w, cp)
	}
	if err == nil {
		w.wait, w.next = 0, time.Time{}
		if w.failing != nil {
			w.failing = nil
			p.Logger.Info("witness cosigns again", "witness", name, "size", cp.Size)
			p.record(ctx, Event{Witness: name, Size: cp.Size})
		}
		return
	}
	w.wait = min(max(2*w.wait, minRetry), maxRetry)
	w.next = time.Now().Add(w.wait)
	var refused *RefusedError
	changed := w.failing == nil || w.failing.Error() != err.Error()
	w.failing = err
	p.Logger.Warn("witness did not cosign; the log goes on", "witness", name, "size", cp.Size, "retry_in", w.wait, "err", err)
	if changed {
		p.record(ctx, Event{Witness: name, Size: cp.Size, Err: err, Refused: errors.As(err, &refused)})
	}
}

func (p *Pusher) try(ctx context.Context, w *witnessState, cp audit.Checkpoint) error {
	var proof tlog.TreeProof
	if w.acked > 0 && w.acked < cp.Size {
		var err error
		if proof, err = p.Proof(w.acked, cp.Size); err != nil {
			return fmt.Errorf("consistency proof from %d to %d: %w", w.acked, cp.Size, err)
		}
	}
	sigs, err := w.t.Client.AddCheckpoint(ctx, w.acked, proof, cp.Note)
	if err != nil {
		return err
	}
	if err := audit.AddCosignatures(p.Dir, cp.Size, p.LogKey, sigs); err != nil {
		return fmt.Errorf("keep the cosignature: %w", err)
	}
	w.acked = cp.Size
	if err := p.saveAcked(w.t.Client.Key.Name(), cp.Size); err != nil {
		p.Logger.Warn("witness progress not saved; the next start proves from further back", "err", err)
	}
	return nil
}

func (p *Pusher) record(ctx context.Context, ev Event) {
	if p.Record != nil {
		p.Record(ctx, ev)
	}
}

// The size each witness last cosigned is kept in the log's directory,
// under witnesses/, a file per witness.
func (p *Pusher) ackedPath(name string) string {
	sum := sha256.Sum256([]byte(name))
	return filepath.Join(p.Dir, "witnesses", hex.EncodeToString(sum[:12]))
}

func (p *Pusher) loadAcked(name string) uint64 {
	b, err := os.ReadFile(p.ackedPath(name))
	if err != nil {
		return 0 // none yet: the witness says where it is (409)
	}
	n, _ := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	return n
}

func (p *Pusher) saveAcked(name string, size uint64) error {
	if err := os.MkdirAll(filepath.Join(p.Dir, "witnesses"), 0o700); err != nil {
		return err
	}
	return atomicfile.WriteFile(p.ackedPath(name), fmt.Appendf(nil, "%d\n", size), 0o600)
}
