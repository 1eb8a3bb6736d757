package vm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/carrel-os/carrel/supervisor/agentlink"
	"github.com/carrel-os/carrel/supervisor/registry"
)

// EventKind names a step in a VM's life.
type EventKind string

// The steps Config.OnEvent hears about.
const (
	EventCreated  EventKind = "created"
	EventStarting EventKind = "starting" // a new session; QEMU is about to start
	EventStarted  EventKind = "started"  // the agent answered
	EventAdopted  EventKind = "adopted"  // a new carreld found it running
	EventStopping EventKind = "stopping"
	EventStopped  EventKind = "stopped"
	EventFailed   EventKind = "failed" // a boot that did not come up
	EventRemoved  EventKind = "removed"
	EventPaused   EventKind = "paused"
	EventResumed  EventKind = "resumed"
	// EventReset: the VM's writable layer (and, if the reason says so, its
	// workspace) was discarded; its next boot is the verified image.
	EventReset EventKind = "reset"
	// The VM's GPUs: attached before its QEMU starts (the boot stops if
	// that cannot be recorded), detached once a run that had them ends.
	EventGPUAttach EventKind = "gpu-attach"
	EventGPUDetach EventKind = "gpu-detach"
	// EventSnapshot: a snapshot was taken (Event.Snapshot); the VM runs
	// on. EventSnapshotDeleted: one was deleted.
	EventSnapshot        EventKind = "snapshot"
	EventSnapshotDeleted EventKind = "snapshot-deleted"
)

// Event is one step in a VM's life. Record is the VM's record as of the
// step; its Session names the run the step belongs to.
type Event struct {
	Kind   EventKind
	Record registry.Record
	Reason string
	// Snapshot is the snapshot a snapshot event is about.
	Snapshot *Snapshot
}

// event tells Config.OnEvent about a step. The steps before QEMU starts
// (created, starting) and a reset, before it discards anything, fail the
// operation when they cannot be recorded;
// for the others the VM has already changed, so a failure is logged.
func (m *Manager) event(ctx context.Context, mc *machine, kind EventKind, reason string) error {
	return m.eventSnap(ctx, mc, kind, nil, reason)
}

// eventSnap is event, about snapshot s.
func (m *Manager) eventSnap(ctx context.Context, mc *machine, kind EventKind, s *Snapshot, reason string) error {
	if m.cfg.OnEvent == nil {
		return nil
	}
	ev := Event{Kind: kind, Record: mc.snapshot(), Reason: reason, Snapshot: s}
	err := m.cfg.OnEvent(context.WithoutCancel(ctx), ev)
	if err == nil {
		return nil
	}
	switch kind {
	case EventCreated, EventStarting, EventGPUAttach, EventReset:
		return fmt.Errorf("vm %q not started: %w", ev.Record.Name, err)
	}
	m.log.Error("vm event not recorded", "vm", ev.Record.Name, "event", kind, "err", err)
	return nil
}

func newSession() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return "ses_" + hex.EncodeToString(b[:])
}

// SessionOf returns the session of a VM's current (or latest) run.
func (m *Manager) SessionOf(name string) string {
	mc, err := m.get(name)
	if err != nil {
		return ""
	}
	mc.mu.Lock()
	defer mc.mu.Unlock()
	return mc.rec.Session
}

// PauseAll stops the vCPUs of every running VM, for reason (the audit log
// cannot be written, say). VMs stay paused until ResumeAll. A VM that
// starts meanwhile is paused as soon as its boot ends.
func (m *Manager) PauseAll(ctx context.Context, reason string) error {
	m.mu.Lock()
	m.pausedFor = reason
	m.pausedAt = time.Now()
	mcs := m.machinesLocked()
	m.mu.Unlock()
	var errs []error
	for _, mc := range mcs {
		errs = append(errs, m.pause(ctx, mc, reason))
	}
	return errors.Join(errs...)
}

// ResumeAll resumes the VMs PauseAll paused.
func (m *Manager) ResumeAll(ctx context.Context) error {
	m.mu.Lock()
	reason, since := m.pausedFor, m.pausedAt
	m.pausedFor = ""
	mcs := m.machinesLocked()
	m.mu.Unlock()
	var (
		errs []error
		wg   sync.WaitGroup
	)
	for _, mc := range mcs {
		mc.mu.Lock()
		paused, inst, byOperator := mc.paused, mc.rec.Instance, mc.rec.Paused
		mc.paused = false
		mc.mu.Unlock()
		if !paused || inst == nil || byOperator {
			m.holdLink(ctx, mc)
			continue
		}
		if err := m.cfg.Driver.Resume(ctx, *inst); err != nil {
			// Its link is released: the keepalive says what the guest is.
			wg.Go(func() { m.holdLink(ctx, mc) })
			errs = append(errs, fmt.Errorf("resume vm %q: %w", mc.rec.Name, err))
			continue
		}
		// Each VM's link comes back on its own time, at once unless the
		// pause outlasted its connection.
		wg.Go(func() {
			m.holdLink(ctx, mc)
			m.log.Info("vm resumed", "vm", mc.rec.Name, "paused_for", time.Since(since).Round(time.Millisecond))
			// The pause could not be recorded while the log was down; both
			// are recorded now.
			_ = m.event(ctx, mc, EventPaused, fmt.Sprintf("%s (at %s)", reason, since.UTC().Format(time.RFC3339Nano)))
			_ = m.event(ctx, mc, EventResumed, fmt.Sprintf("paused for %s", time.Since(since).Round(time.Millisecond)))
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// pause pauses mc if it runs and is not paused yet.
func (m *Manager) pause(ctx context.Context, mc *machine, reason string) error {
	mc.mu.Lock()
	inst, state := mc.rec.Instance, mc.rec.State
	if mc.paused || inst == nil || state != registry.StateRunning {
		mc.mu.Unlock()
		return nil
	}
	mc.paused = true
	byOperator := mc.rec.Paused
	mc.mu.Unlock()
	if byOperator {
		m.holdLink(ctx, mc) // already stopped; held now as well
		return nil
	}
	if err := m.cfg.Driver.Pause(ctx, *inst); err != nil {
		mc.mu.Lock()
		mc.paused = false
		mc.mu.Unlock()
		return fmt.Errorf("pause vm %q: %w", mc.rec.Name, err)
	}
	m.holdLink(ctx, mc)
	m.log.Warn("vm paused", "vm", mc.rec.Name, "reason", reason)
	return nil
}

// holdLink holds mc's agent link while its vCPUs are stopped, by carreld
// (PauseAll) or by its operator (Pause), and releases it otherwise (see
// agentlink.Hold): no probes or new connections to a guest that cannot
// answer, and a call that the pause outlasts fails with its reason, not
// as a broken link. It decides and acts under mc's lock, so that the last
// call sees the last change to either pause. A release after a pause that
// outlasted the connection waits for the agent to answer on a new one.
func (m *Manager) holdLink(ctx context.Context, mc *machine) {
	m.mu.Lock()
	why := m.pausedFor
	m.mu.Unlock()
	var resync func(context.Context) error
	mc.mu.Lock()
	link, name := mc.link, mc.rec.Name
	switch {
	case link == nil:
	case mc.paused:
		if why == "" {
			why = "carreld holds every vm paused"
		}
		link.Hold(why + "; carreld resumes the vm when that is fixed")
	case mc.rec.Paused && mc.rec.State == registry.StateRunning: // not while it stops
		link.Hold(fmt.Sprintf("paused by request; resume it first (carrel vm resume %s)", name))
	default:
		resync = link.Release()
	}
	mc.mu.Unlock()
	if resync == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), resyncTimeout)
	defer cancel()
	if err := resync(ctx); err != nil && !errors.Is(err, agentlink.ErrHeld) && !errors.Is(err, net.ErrClosed) {
		m.log.Warn("guest agent did not answer again after the pause", "vm", name, "err", err)
	}
}

// resyncTimeout bounds how long a resume waits for the agent to answer on
// a fresh connection when the pause outlasted the old one.
const resyncTimeout = 15 * time.Second

// pauseIfHeld pauses a VM that came up while every VM is held paused.
func (m *Manager) pauseIfHeld(ctx context.Context, mc *machine) {
	m.mu.Lock()
	reason := m.pausedFor
	m.mu.Unlock()
	if reason == "" {
		return
	}
	if err := m.pause(ctx, mc, reason); err != nil {
		m.log.Error("vm not paused", "vm", mc.rec.Name, "err", err)
	}
}

func (m *Manager) machinesLocked() []*machine {
	mcs := make([]*machine, 0, len(m.vms))
	for _, mc := range m.vms {
		mcs = append(mcs, mc)
	}
	return mcs
}
