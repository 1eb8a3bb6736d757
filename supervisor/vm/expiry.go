package vm

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/carrel-os/carrel/supervisor/registry"
)

// Caps on what a create may attach to a VM.
const (
	MaxEnv        = 256
	MaxEnvPair    = 4 << 10
	MaxLabels     = 64
	MaxLabelKey   = 64
	MaxLabelValue = 512
	// MaxTTL bounds a VM's time to live, from creation or SetExpiry.
	MaxTTL = 365 * 24 * time.Hour
)

// EventExpired is recorded when carreld ends a VM whose time is up,
// before it deletes or stops it.
const EventExpired EventKind = "expired"

// expiryTick is how often carreld looks for VMs whose time is up.
const expiryTick = time.Second

func validEnv(env []string) error {
	if len(env) > MaxEnv {
		return fmt.Errorf("%w: %d environment variables, at most %d", ErrInvalid, len(env), MaxEnv)
	}
	for _, kv := range env {
		k, _, ok := strings.Cut(kv, "=")
		switch {
		case !ok || k == "":
			return fmt.Errorf("%w: environment entry %.64q is not KEY=VALUE", ErrInvalid, kv)
		case len(kv) > MaxEnvPair:
			return fmt.Errorf("%w: environment entry %.64q is over %d bytes", ErrInvalid, k, MaxEnvPair)
		case strings.ContainsRune(kv, 0) || !utf8.ValidString(kv):
			return fmt.Errorf("%w: environment entry %.64q has a NUL or invalid UTF-8", ErrInvalid, k)
		}
	}
	return nil
}

func validLabels(labels map[string]string) error {
	if len(labels) > MaxLabels {
		return fmt.Errorf("%w: %d labels, at most %d", ErrInvalid, len(labels), MaxLabels)
	}
	for k, v := range labels {
		switch {
		case k == "" || len(k) > MaxLabelKey || len(v) > MaxLabelValue:
			return fmt.Errorf("%w: label %.64q: keys are 1 to %d bytes, values at most %d", ErrInvalid, k, MaxLabelKey, MaxLabelValue)
		case !utf8.ValidString(k) || !utf8.ValidString(v) || strings.ContainsRune(k+v, 0):
			return fmt.Errorf("%w: label %.64q has a NUL or invalid UTF-8", ErrInvalid, k)
		}
	}
	return nil
}

func validExpiry(ttl time.Duration, action *string) error {
	if ttl < 0 || ttl > MaxTTL {
		return fmt.Errorf("%w: time to live %s is out of range (0 to %s)", ErrInvalid, ttl, MaxTTL)
	}
	switch *action {
	case "":
		*action = registry.ExpireDelete
	case registry.ExpireDelete, registry.ExpireStop:
	default:
		return fmt.Errorf("%w: expiry action %q: want %s or %s", ErrInvalid, *action, registry.ExpireDelete, registry.ExpireStop)
	}
	return nil
}

// EnvOf returns the environment every command in the VM gets (CreateParams.Env).
func (m *Manager) EnvOf(name string) []string {
	mc, err := m.get(name)
	if err != nil {
		return nil
	}
	mc.mu.Lock()
	defer mc.mu.Unlock()
	return mc.rec.Env
}

// SetExpiry has carreld end the VM ttl from now, as it was created to
// (delete or stop); 0 clears its expiry.
func (m *Manager) SetExpiry(ctx context.Context, name string, ttl time.Duration) (registry.Record, error) {
	action := ""
	if err := validExpiry(ttl, &action); err != nil {
		return registry.Record{}, err
	}
	var rec registry.Record
	err := m.locked(ctx, name, func(mc *machine) error {
		err := m.persist(mc, func(r *registry.Record) {
			r.ExpiresAt = time.Time{}
			if ttl > 0 {
				r.ExpiresAt = time.Now().UTC().Add(ttl).Truncate(time.Millisecond)
			}
			if r.ExpiryAction == "" {
				r.ExpiryAction = registry.ExpireDelete
			}
		})
		rec = mc.snapshot()
		return err
	})
	return rec, err
}

// ReapExpired ends, until ctx ends, every VM whose time is up, as its
// record says: deleted, or stopped (its expiry then cleared, so that a
// later start is not ended at once). A VM to delete that forks stand on
// is stopped instead. Each gets an "expired" lifecycle
// record first. A VM busy with another operation is tried again at the
// next tick.
func (m *Manager) ReapExpired(ctx context.Context) {
	t := time.NewTicker(expiryTick)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, name := range m.expired(time.Now()) {
			if err := m.expire(ctx, name); err != nil && !errors.Is(err, ErrNotFound) {
				m.log.Warn("expire vm", "vm", name, "err", err)
			}
		}
	}
}

// expired names the VMs whose time was up at now.
func (m *Manager) expired(now time.Time) []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var names []string
	for name, mc := range m.vms {
		mc.mu.Lock()
		at, state := mc.rec.ExpiresAt, mc.rec.State
		mc.mu.Unlock()
		if !at.IsZero() && !now.Before(at) && state != registry.StateCreating {
			names = append(names, name)
		}
	}
	return names
}

func (m *Manager) expire(ctx context.Context, name string) error {
	end, err := m.begin()
	if err != nil {
		return err
	}
	defer end()
	mc, err := m.get(name)
	if err != nil {
		return err
	}
	lctx, cancel := context.WithTimeout(ctx, time.Second)
	err = mc.lock(lctx)
	cancel()
	if err != nil {
		return err // busy: the next tick tries again
	}
	rec := mc.snapshot()
	if rec.ExpiresAt.IsZero() || time.Now().Before(rec.ExpiresAt) {
		mc.unlock() // moved meanwhile
		return nil
	}
	action, why := rec.ExpiryAction, ""
	if action == "" {
		action = registry.ExpireDelete
	}
	// A VM that forks stand on cannot be deleted: it is stopped instead,
	// so that it runs no longer than it was meant to, and nothing is lost.
	if deps := m.dependents(name); action == registry.ExpireDelete && len(deps) > 0 {
		action, why = registry.ExpireStop, " (not delete: "+strings.Join(deps, ", ")+" stand on its disk layers)"
	}
	// Recorded once per expiry: an action that keeps failing is tried
	// again each tick, not recorded again.
	m.mu.Lock()
	first := m.expiryRecorded[name] != rec.ExpiresAt
	if first {
		if m.expiryRecorded == nil {
			m.expiryRecorded = map[string]time.Time{}
		}
		m.expiryRecorded[name] = rec.ExpiresAt
	}
	m.mu.Unlock()
	if first {
		_ = m.event(ctx, mc, EventExpired, "its time to live ended at "+rec.ExpiresAt.Format(time.RFC3339)+"; "+action+why)
	}
	m.log.Info("vm expired", "vm", name, "action", action)
	defer mc.unlock()
	ctx = context.WithoutCancel(ctx)
	if action == registry.ExpireStop {
		if err := m.stopLocked(ctx, mc, false); err != nil {
			return err
		}
		return m.persist(mc, func(r *registry.Record) { r.ExpiresAt = time.Time{} })
	}
	return m.deleteLocked(ctx, mc, name, true)
}
