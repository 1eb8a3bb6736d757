package vm

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/supervisor/registry"
)

func TestCreateParamsEnvLabelsExpiry(t *testing.T) {
	labels := func(n int) map[string]string {
		m := map[string]string{}
		for i := range n {
			m[fmt.Sprintf("k%d", i)] = "v"
		}
		return m
	}
	env := func(n int) []string {
		out := make([]string, n)
		for i := range out {
			out[i] = "K=v"
		}
		return out
	}
	tests := []struct {
		name string
		p    CreateParams
		ok   bool
		// action is the ExpiryAction validate leaves, when ok.
		action string
	}{
		{"none", CreateParams{}, true, registry.ExpireDelete},
		{"env", CreateParams{Env: []string{"A=1", "B=", "C=x=y", "PATH=/bin"}}, true, registry.ExpireDelete},
		{"256 env entries", CreateParams{Env: env(MaxEnv)}, true, registry.ExpireDelete},
		{"an env entry at the cap", CreateParams{Env: []string{"K=" + strings.Repeat("v", MaxEnvPair-2)}}, true, registry.ExpireDelete},
		{"labels", CreateParams{Labels: map[string]string{"team": "x", "empty": "", "ünicode": "ü"}}, true, registry.ExpireDelete},
		{"64 labels", CreateParams{Labels: labels(MaxLabels)}, true, registry.ExpireDelete},
		{"a label at the caps", CreateParams{Labels: map[string]string{strings.Repeat("k", MaxLabelKey): strings.Repeat("v", MaxLabelValue)}}, true, registry.ExpireDelete},
		{"a ttl", CreateParams{TTL: time.Minute}, true, registry.ExpireDelete},
		{"the longest ttl", CreateParams{TTL: MaxTTL}, true, registry.ExpireDelete},
		{"delete", CreateParams{TTL: time.Minute, ExpiryAction: registry.ExpireDelete}, true, registry.ExpireDelete},
		{"stop", CreateParams{TTL: time.Minute, ExpiryAction: registry.ExpireStop}, true, registry.ExpireStop},
		{"stop without a ttl", CreateParams{ExpiryAction: registry.ExpireStop}, true, registry.ExpireStop},

		{"257 env entries", CreateParams{Env: env(MaxEnv + 1)}, false, ""},
		{"an env entry over the cap", CreateParams{Env: []string{"K=" + strings.Repeat("v", MaxEnvPair-1)}}, false, ""},
		{"no =", CreateParams{Env: []string{"A"}}, false, ""},
		{"no key", CreateParams{Env: []string{"=1"}}, false, ""},
		{"an empty entry", CreateParams{Env: []string{""}}, false, ""},
		{"a NUL in env", CreateParams{Env: []string{"A=1\x002"}}, false, ""},
		{"invalid UTF-8 in env", CreateParams{Env: []string{"A=\xff"}}, false, ""},
		{"65 labels", CreateParams{Labels: labels(MaxLabels + 1)}, false, ""},
		{"an empty label key", CreateParams{Labels: map[string]string{"": "v"}}, false, ""},
		{"a label key over the cap", CreateParams{Labels: map[string]string{strings.Repeat("k", MaxLabelKey+1): "v"}}, false, ""},
		{"a label value over the cap", CreateParams{Labels: map[string]string{"k": strings.Repeat("v", MaxLabelValue+1)}}, false, ""},
		{"a NUL in a label key", CreateParams{Labels: map[string]string{"k\x00": "v"}}, false, ""},
		{"a NUL in a label value", CreateParams{Labels: map[string]string{"k": "v\x00"}}, false, ""},
		{"invalid UTF-8 in a label", CreateParams{Labels: map[string]string{"k": "\xc3"}}, false, ""},
		{"a negative ttl", CreateParams{TTL: -time.Second}, false, ""},
		{"a ttl over the cap", CreateParams{TTL: MaxTTL + time.Second}, false, ""},
		{"another action", CreateParams{TTL: time.Minute, ExpiryAction: "kill"}, false, ""},
		{"upper case", CreateParams{TTL: time.Minute, ExpiryAction: "Stop"}, false, ""},
		{"padded", CreateParams{TTL: time.Minute, ExpiryAction: " delete"}, false, ""},
	}
	for _, tt := range tests {
		p := tt.p
		p.Name, p.Image = "a", "dev"
		err := p.validate()
		switch {
		case tt.ok && err != nil:
			t.Errorf("%s: %v", tt.name, err)
		case tt.ok && p.ExpiryAction != tt.action:
			t.Errorf("%s: expiry action %q, want %q", tt.name, p.ExpiryAction, tt.action)
		case !tt.ok && !errors.Is(err, ErrInvalid):
			t.Errorf("%s: %v, want ErrInvalid", tt.name, err)
		}
	}

	// Refused by Create too, leaving nothing.
	e := newEnv(t)
	for _, p := range []CreateParams{
		{Name: "a", Image: "dev", Env: []string{"nokey"}},
		{Name: "a", Image: "dev", Labels: map[string]string{"": ""}},
		{Name: "a", Image: "dev", TTL: time.Minute, ExpiryAction: "pause"},
	} {
		if _, err := e.m.Create(context.Background(), p); !errors.Is(err, ErrInvalid) {
			t.Errorf("create %+v: %v", p, err)
		}
	}
	if len(e.m.List()) != 0 || e.drv.Running() != 0 {
		t.Error("a refused create left a VM")
	}
}

// TestCreateKeepsEnvLabelsAndExpiry: what a create attaches to a VM is in
// its record, in memory and on disk, and EnvOf gives the env.
func TestCreateKeepsEnvLabelsAndExpiry(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	env := []string{"A=1", "B=two"}
	labels := map[string]string{"team": "x"}
	rec, err := e.m.Create(ctx, CreateParams{Name: "a", Image: "dev", Env: env, Labels: labels, TTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if want := rec.CreatedAt.Add(time.Hour); !rec.ExpiresAt.Equal(want) || rec.ExpiryAction != registry.ExpireDelete {
		t.Errorf("expires at %s (%q), want %s (delete)", rec.ExpiresAt, rec.ExpiryAction, want)
	}
	onDisk, err := e.reg.Get("a")
	if err != nil {
		t.Fatal(err)
	}
	if !onDisk.ExpiresAt.Equal(rec.ExpiresAt) || onDisk.ExpiryAction != registry.ExpireDelete ||
		!slices.Equal(onDisk.Env, env) || onDisk.Labels["team"] != "x" || len(onDisk.Labels) != 1 {
		t.Errorf("persisted %+v", onDisk)
	}
	if got := e.m.EnvOf("a"); !slices.Equal(got, env) {
		t.Errorf("EnvOf = %q, want %q", got, env)
	}
	if got := e.m.EnvOf("nope"); got != nil {
		t.Errorf("EnvOf of no VM = %q", got)
	}

	rec, err = e.m.Create(ctx, CreateParams{Name: "b", Image: "dev", ExpiryAction: registry.ExpireStop})
	if err != nil {
		t.Fatal(err)
	}
	if !rec.ExpiresAt.IsZero() || rec.ExpiryAction != registry.ExpireStop {
		t.Errorf("without a ttl: expires at %s (%q)", rec.ExpiresAt, rec.ExpiryAction)
	}
	if got := e.m.EnvOf("b"); len(got) != 0 {
		t.Errorf("EnvOf of a VM created without env = %q", got)
	}
}

func TestSetExpiry(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	if _, err := e.m.Create(ctx, CreateParams{Name: "a", Image: "dev", ExpiryAction: registry.ExpireStop}); err != nil {
		t.Fatal(err)
	}
	before := time.Now()
	rec, err := e.m.SetExpiry(ctx, "a", 10*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	lo, hi := before.Add(10*time.Minute).Add(-time.Millisecond), time.Now().Add(10*time.Minute)
	if rec.ExpiresAt.Before(lo) || rec.ExpiresAt.After(hi) {
		t.Errorf("expires at %s, want between %s and %s", rec.ExpiresAt, lo, hi)
	}
	if rec.ExpiryAction != registry.ExpireStop {
		t.Errorf("SetExpiry changed the action to %q", rec.ExpiryAction)
	}
	if onDisk, _ := e.reg.Get("a"); !onDisk.ExpiresAt.Equal(rec.ExpiresAt) {
		t.Errorf("persisted expiry %s, want %s", onDisk.ExpiresAt, rec.ExpiresAt)
	}
	if got := e.m.expired(time.Now()); len(got) != 0 {
		t.Errorf("expired now: %q", got)
	}
	if got := e.m.expired(rec.ExpiresAt); !slices.Equal(got, []string{"a"}) {
		t.Errorf("expired at its time: %q", got)
	}

	rec, err = e.m.SetExpiry(ctx, "a", 0)
	if err != nil {
		t.Fatal(err)
	}
	if !rec.ExpiresAt.IsZero() {
		t.Errorf("cleared expiry is %s", rec.ExpiresAt)
	}
	if onDisk, _ := e.reg.Get("a"); !onDisk.ExpiresAt.IsZero() {
		t.Errorf("persisted cleared expiry is %s", onDisk.ExpiresAt)
	}
	if got := e.m.expired(time.Now().Add(MaxTTL)); len(got) != 0 {
		t.Errorf("a VM without an expiry expired: %q", got)
	}

	for _, ttl := range []time.Duration{-time.Second, MaxTTL + time.Second} {
		if _, err := e.m.SetExpiry(ctx, "a", ttl); !errors.Is(err, ErrInvalid) {
			t.Errorf("SetExpiry(%s): %v", ttl, err)
		}
	}
	if _, err := e.m.SetExpiry(ctx, "nope", time.Minute); !errors.Is(err, ErrNotFound) {
		t.Errorf("SetExpiry of no VM: %v", err)
	}
}

// endNow puts the VM's expiry in the past, as if its time had passed.
func (e *env) endNow(t *testing.T, name string) {
	t.Helper()
	mc, err := e.m.get(name)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.m.persist(mc, func(r *registry.Record) { r.ExpiresAt = time.Now().Add(-time.Second).UTC() }); err != nil {
		t.Fatal(err)
	}
}

func (l *eventLog) find(kind EventKind) (Event, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, ev := range l.evs {
		if ev.Kind == kind {
			return ev, true
		}
	}
	return Event{}, false
}

func TestExpireDeletes(t *testing.T) {
	e := newEnv(t)
	l := &eventLog{}
	e.withEvents(l)
	ctx := context.Background()
	if _, err := e.m.Create(ctx, CreateParams{Name: "a", Image: "dev", TTL: time.Hour}); err != nil {
		t.Fatal(err)
	}
	e.create(t, "b") // no expiry: left alone
	e.endNow(t, "a")
	if got := e.m.expired(time.Now()); !slices.Equal(got, []string{"a"}) {
		t.Fatalf("expired: %q", got)
	}
	if err := e.m.expire(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.m.Get("a"); !errors.Is(err, ErrNotFound) {
		t.Errorf("get after expiry: %v", err)
	}
	if _, err := e.reg.Get("a"); !errors.Is(err, registry.ErrNotFound) {
		t.Errorf("record after expiry: %v", err)
	}
	if e.drv.Running() != 1 {
		t.Errorf("%d VMs running, want b alone", e.drv.Running())
	}
	if got, want := l.kinds(), "created,starting,started,created,starting,started,expired,stopping,stopped,removed"; got != want {
		t.Errorf("events %s, want %s", got, want)
	}
	ev, _ := l.find(EventExpired)
	if ev.Record.Name != "a" || !strings.Contains(ev.Reason, "delete") {
		t.Errorf("expired event %+v", ev)
	}
	if err := e.m.expire(ctx, "a"); !errors.Is(err, ErrNotFound) {
		t.Errorf("expire of a deleted VM: %v", err)
	}
	if st, err := e.m.Get("b"); err != nil || st.State != registry.StateRunning {
		t.Errorf("b: %+v, %v", st, err)
	}
}

func TestExpireStops(t *testing.T) {
	e := newEnv(t)
	l := &eventLog{}
	e.withEvents(l)
	ctx := context.Background()
	if _, err := e.m.Create(ctx, CreateParams{Name: "a", Image: "dev", TTL: time.Hour, ExpiryAction: registry.ExpireStop}); err != nil {
		t.Fatal(err)
	}
	e.endNow(t, "a")
	if err := e.m.expire(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	st, err := e.m.Get("a")
	if err != nil {
		t.Fatal(err)
	}
	if st.State != registry.StateStopped || !st.ExpiresAt.IsZero() || st.ExpiryAction != registry.ExpireStop {
		t.Errorf("after expiry: state %s, expires at %s (%q)", st.State, st.ExpiresAt, st.ExpiryAction)
	}
	if onDisk, _ := e.reg.Get("a"); onDisk.State != registry.StateStopped || !onDisk.ExpiresAt.IsZero() {
		t.Errorf("persisted: state %s, expires at %s", onDisk.State, onDisk.ExpiresAt)
	}
	if e.drv.Running() != 0 {
		t.Error("the expired VM still runs")
	}
	if got, want := l.kinds(), "created,starting,started,expired,stopping,stopped"; got != want {
		t.Errorf("events %s, want %s", got, want)
	}
	if ev, _ := l.find(EventExpired); !strings.Contains(ev.Reason, "stop") {
		t.Errorf("expired event %+v", ev)
	}
	// Its expiry is cleared: started again, it is not ended at once.
	if _, err := e.m.Start(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if got := e.m.expired(time.Now().Add(MaxTTL)); len(got) != 0 {
		t.Errorf("expired after a restart: %q", got)
	}
}

// TestExpiryMovedMeanwhile: a VM found expired whose expiry is moved
// before the reaper acts is left alone.
func TestExpiryMovedMeanwhile(t *testing.T) {
	e := newEnv(t)
	l := &eventLog{}
	e.withEvents(l)
	ctx := context.Background()
	if _, err := e.m.Create(ctx, CreateParams{Name: "a", Image: "dev", TTL: time.Hour}); err != nil {
		t.Fatal(err)
	}
	e.endNow(t, "a")
	if got := e.m.expired(time.Now()); !slices.Equal(got, []string{"a"}) {
		t.Fatalf("expired: %q", got)
	}
	if _, err := e.m.SetExpiry(ctx, "a", time.Hour); err != nil {
		t.Fatal(err)
	}
	if err := e.m.expire(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if st, err := e.m.Get("a"); err != nil || st.State != registry.StateRunning {
		t.Errorf("after a moved expiry: %+v, %v", st, err)
	}
	// Cleared meanwhile: left alone too.
	e.endNow(t, "a")
	if _, err := e.m.SetExpiry(ctx, "a", 0); err != nil {
		t.Fatal(err)
	}
	if err := e.m.expire(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if st, err := e.m.Get("a"); err != nil || st.State != registry.StateRunning {
		t.Errorf("after a cleared expiry: %+v, %v", st, err)
	}
	if _, ok := l.find(EventExpired); ok {
		t.Errorf("an expired event for a VM left alone: %s", l.kinds())
	}
}

// TestReapExpired: the reaper ends an expired VM within a tick or two,
// and returns when its context ends.
func TestReapExpired(t *testing.T) {
	e := newEnv(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { e.m.ReapExpired(ctx); close(done) }()
	defer func() {
		cancel()
		select {
		case <-done:
		case <-time.After(2 * time.Second):
			t.Error("ReapExpired did not return when its context ended")
		}
	}()
	if _, err := e.m.Create(context.Background(), CreateParams{Name: "a", Image: "dev", TTL: time.Hour}); err != nil {
		t.Fatal(err)
	}
	e.create(t, "b")
	e.endNow(t, "a")
	deadline := time.Now().Add(3 * expiryTick)
	for {
		if _, err := e.m.Get("a"); errors.Is(err, ErrNotFound) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the reaper did not delete the expired VM")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, err := e.m.Get("b"); err != nil {
		t.Errorf("b: %v", err)
	}
}

// TestExpireWithForks: a VM to delete at expiry that forks stand on is
// stopped instead, once, with the reason on record; the fork runs on.
func TestExpireWithForks(t *testing.T) {
	e := newEnv(t)
	l := &eventLog{}
	e.withEvents(l)
	e.withSystemImage(t, true)
	ctx := context.Background()
	if _, err := e.m.Create(ctx, CreateParams{Name: "a", Image: "sys", TTL: time.Hour}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.m.Snapshot(ctx, "a", SnapshotParams{Name: "s1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.m.Fork(ctx, "a", "b", "s1"); err != nil {
		t.Fatal(err)
	}
	e.endNow(t, "a")
	if err := e.m.expire(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	st, err := e.m.Get("a")
	if err != nil {
		t.Fatal(err)
	}
	if st.State != registry.StateStopped || !st.ExpiresAt.IsZero() {
		t.Errorf("a after expiry: state %s, expires at %s; want stopped, no expiry", st.State, st.ExpiresAt)
	}
	if got := e.m.expired(time.Now().Add(time.Hour)); len(got) != 0 {
		t.Errorf("still expired: %q", got)
	}
	ev, _ := l.find(EventExpired)
	if !strings.Contains(ev.Reason, "not delete: b stand on its disk layers") {
		t.Errorf("expired event reason %q", ev.Reason)
	}
	if b, err := e.m.Get("b"); err != nil || b.State != registry.StateRunning {
		t.Errorf("the fork: %+v, %v", b, err)
	}
}

// TestRemovedIsTold: each VM deleted, by a call or at its expiry, is told
// to Config.OnRemoved (carreld revokes its tokens there).
func TestRemovedIsTold(t *testing.T) {
	e := newEnv(t)
	e.m.Close()
	var removed []string
	e.m = New(Config{Registry: e.reg, Images: e.img, Driver: e.drv, BootTimeout: 2 * time.Second, StopTimeout: time.Second,
		OnRemoved: func(name string) { removed = append(removed, name) }})
	ctx := context.Background()
	e.create(t, "a")
	if _, err := e.m.Create(ctx, CreateParams{Name: "b", Image: "dev", TTL: time.Hour}); err != nil {
		t.Fatal(err)
	}
	if err := e.m.Delete(ctx, "a", true); err != nil {
		t.Fatal(err)
	}
	e.endNow(t, "b")
	if err := e.m.expire(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(removed, []string{"a", "b"}) {
		t.Errorf("told of %v, want [a b]", removed)
	}
}
