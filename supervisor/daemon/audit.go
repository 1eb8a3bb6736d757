package daemon

import (
	"context"
	"log/slog"
	"sync"

	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/systemd"
	"github.com/carrel-os/carrel/supervisor/vm"
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
func openAudit(dir string, log *slog.Logger, faults *faultHandler) (*audit.Log, error) {
	l, err := audit.Open(dir, audit.Options{
		Logger: log,
		OnFault: func(err error) {
			log.Error("audit log unavailable: every call is refused and every vm paused until it can be written again", "err", err)
			faults.set(err)
		},
		OnRecover: func() {
			log.Info("audit log writable again; resuming vms")
			faults.set(nil)
		},
	})
	if err != nil {
		return nil, err
	}
	if r := l.Recovered(); r.TruncatedBytes > 0 || len(r.UnknownOutcomes) > 0 {
		log.Warn("audit log recovered", "truncated_bytes", r.TruncatedBytes, "reason", r.TailReason, "unknown_outcomes", len(r.UnknownOutcomes))
	}
	log.Info("audit log open", "dir", dir, "records", l.Size(), "key", l.PublicKey())
	return l, nil
}
