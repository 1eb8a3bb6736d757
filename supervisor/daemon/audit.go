package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"

	"golang.org/x/mod/sumdb/note"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/systemd"
	"github.com/carrel-os/carrel/supervisor/vm"
	"github.com/carrel-os/carrel/supervisor/witness"
)

// faultHandler pauses every VM while the audit log cannot be written and
// resumes them when it can: nothing may happen that is not on record. The
// log's callbacks only note the state; one goroutine acts on the latest.
type faultHandler struct {
	log  *slog.Logger
	mu   sync.Mutex
	mgr  *vm.Manager
	down error // the fault, nil when writable
	kick chan struct{}
}

func newFaultHandler(log *slog.Logger) *faultHandler {
	return &faultHandler{log: log, kick: make(chan struct{}, 1)}
}

func (f *faultHandler) set(err error) {
	f.mu.Lock()
	f.down = err
	f.mu.Unlock()
	select {
	case f.kick <- struct{}{}:
	default:
	}
}

// run acts on the log's state until ctx ends, once mgr exists.
func (f *faultHandler) run(ctx context.Context, mgr *vm.Manager) {
	paused := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-f.kick:
		}
		f.mu.Lock()
		down := f.down
		f.mu.Unlock()
		switch {
		case down != nil && !paused:
			reason := "audit log unavailable: " + down.Error()
			systemd.Status(reason + "; every vm is paused")
			if err := mgr.PauseAll(ctx, reason); err != nil {
				f.log.Error("pausing vms", "err", err)
			}
			paused = true
		case down == nil && paused:
			if err := mgr.ResumeAll(ctx); err != nil {
				f.log.Error("resuming vms", "err", err)
			}
			systemd.Status(status(mgr))
			paused = false
		}
	}
}

// openAudit opens (or recovers) the audit log under the state directory.
func openAudit(dir string, cfg Config, log *slog.Logger, faults *faultHandler, onCheckpoint func(audit.Checkpoint)) (*audit.Log, error) {
	l, err := audit.Open(dir, audit.Options{
		Logger:       log,
		Origin:       cfg.AuditOrigin,
		SegmentBytes: cfg.AuditSegmentBytes,
		SegmentAge:   cfg.AuditSegmentAge,
		// Each checkpoint also goes to the journal, so that a remote
		// journal or syslog keeps a copy, and to the witnesses.
		OnCheckpoint: func(cp audit.Checkpoint) {
			log.Info("audit checkpoint", "records", cp.Size, "root", cp.Root.String(), "note", string(cp.Note))
			if onCheckpoint != nil {
				onCheckpoint(cp)
			}
		},
		OnFault: func(err error) {
			log.Error("audit log unavailable: every call is refused and every vm paused until it can be written again", "err", err)
			faults.set(err)
		},
		OnRecover: func() {
			log.Info("audit log writable again; resuming vms")
			faults.set(nil)
		},
	})
	if errors.Is(err, audit.ErrCorrupt) || errors.Is(err, audit.ErrRecordsLost) {
		return nil, fmt.Errorf("%w\nThe audit log is damaged, and carreld does not cut acknowledged records by itself. To go on, with carreld stopped, run:\n  carrel audit recover --dir %s\nIt seals the damaged log under %s/sealed/ as evidence, read-only, and starts a new log chained to its last good checkpoint; carrel audit verify then names the unreadable records (docs/audit.md, Damage and recovery)", err, dir, dir)
	}
	if err != nil {
		return nil, err
	}
	if r := l.Recovered(); r.TruncatedBytes > 0 || len(r.UnknownOutcomes) > 0 {
		log.Warn("audit log recovered", "truncated_bytes", r.TruncatedBytes, "reason", r.TailReason, "unknown_outcomes", len(r.UnknownOutcomes))
	}
	log.Info("audit log open", "dir", dir, "records", l.Size(), "key", l.PublicKey())
	return l, nil
}

// witnessPusher shows the audit log's checkpoints to the witnesses named
// in specs ("URL,VKEY" each), and records in the log when one starts
// failing or cosigns again. nil when there are none.
func witnessPusher(specs []string, log *slog.Logger) (*witness.Pusher, error) {
	if len(specs) == 0 {
		return nil, nil
	}
	p := &witness.Pusher{Logger: log.With("subsystem", "witness")}
	for _, spec := range specs {
		url, vkey, ok := strings.Cut(spec, ",")
		if !ok || url == "" {
			return nil, fmt.Errorf("--witness %q: want URL,KEY", spec)
		}
		key, err := witness.NewVerifier(vkey)
		if err != nil {
			return nil, fmt.Errorf("--witness %q: %w", spec, err)
		}
		p.Witnesses = append(p.Witnesses, witness.Target{Client: &witness.Client{URL: url, Key: key}})
	}
	return p, nil
}

// startWitnesses wires p to the open log l and runs it until ctx ends.
func startWitnesses(ctx context.Context, p *witness.Pusher, l *audit.Log) error {
	key, err := note.NewVerifier(l.PublicKey())
	if err != nil {
		return err
	}
	p.Dir, p.LogKey, p.Proof = l.Dir(), key, l.ConsistencyProof
	p.Record = func(ctx context.Context, ev witness.Event) {
		w := audit.WitnessEvent{Witness: ev.Witness, Size: ev.Size, Outcome: "cosigning"}
		if ev.Err != nil {
			w.Outcome, w.Error = "failed", protocol.CleanText(ev.Err.Error(), 1024)
			if ev.Refused {
				w.Outcome = "refused"
			}
		}
		data, _ := json.Marshal(w)
		if _, err := l.Append(context.WithoutCancel(ctx), audit.Record{Kind: audit.KindWitness, Provenance: audit.Host, Data: data}); err != nil {
			p.Logger.Error("witness event not recorded", "err", err)
		}
	}
	if cp := l.Checkpoint(); cp != nil {
		p.Checkpoint(*cp) // the latest from before this start
	}
	go p.Run(ctx)
	return nil
}
