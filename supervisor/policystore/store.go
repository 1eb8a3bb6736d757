// Package policystore keeps carreld's named policies: the built-ins, those an
// operator applied (stored under the state directory), their compiled
// forms, and the most recent decisions.
//
// A policy is replaced by compiling and testing the new bundle first and
// only then swapping one pointer, so every decision sees either the old
// policy or the new one, and a bundle that fails leaves the old serving.
package policystore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sync"
	"time"

	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/supervisor/atomicfile"
)

// ErrInvalidName is returned for a policy name outside [a-z][a-z0-9-]{0,62}.
var ErrInvalidName = errors.New("invalid policy name")

// ErrNotRecorded is returned by Decide when the decision could not be made
// durable; the decision is then a deny.
var ErrNotRecorded = errors.New("audit log unavailable: no action is admitted")

var nameRE = regexp.MustCompile(`^[a-z][a-z0-9-]{0,62}$`)

// Info describes one policy.
type Info struct {
	Name      string
	Revision  string
	Builtin   bool
	AppliedAt time.Time // zero for a built-in that was never replaced
}

type entry struct {
	revision  string
	builtin   bool
	appliedAt time.Time

	// A built-in example is compiled when it is first used: each costs
	// about 1 MiB compiled, and most hosts use none of them. Until then
	// src is its bundle; afterwards pol (or err) is set and src is nil.
	once sync.Once
	src  *policy.Bundle
	pol  *policy.Policy
	err  error
}

// compiled returns e's compiled policy, compiling it on first use.
func (e *entry) compiled(name string) (*policy.Policy, error) {
	e.once.Do(func() {
		if e.src == nil {
			return
		}
		e.pol, e.err = policy.Compile(context.Background(), name, e.src)
		if e.err != nil {
			e.err = fmt.Errorf("built-in policy %s: %w", name, e.err)
		}
		e.src = nil
	})
	return e.pol, e.err
}

// compiledEntry is an entry for p, compiled already.
func compiledEntry(p *policy.Policy, builtin bool, appliedAt time.Time) *entry {
	return &entry{revision: p.Revision, builtin: builtin, appliedAt: appliedAt, pol: p}
}

// Store holds every policy by name.
type Store struct {
	dir string // <state>/policies; one directory per applied policy
	log *slog.Logger

	mu      sync.RWMutex
	entries map[string]*entry
	applyMu sync.Mutex // one apply at a time

	decisions *ring
	// Record, when set, makes every decision durable (the audit log). If
	// it fails, the decision becomes a deny: nothing is admitted that is
	// not on record.
	Record func(ctx context.Context, d policy.Decision, in policy.Input) error
}

// Open compiles the default policy and every policy applied earlier under
// dir; the other built-in policies are compiled when first used. A stored
// policy that no longer compiles is an error: carreld must not start with
// a VM's policy silently missing.
func Open(ctx context.Context, dir string, log *slog.Logger) (*Store, error) {
	if log == nil {
		log = slog.Default()
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	s := &Store{dir: dir, log: log, entries: map[string]*entry{}, decisions: newRing(decisionLogSize)}
	for _, name := range policy.BuiltinNames() {
		b, err := policy.Builtin(name)
		if err != nil {
			return nil, fmt.Errorf("built-in policy %s: %w", name, err)
		}
		if name != policy.DefaultName {
			s.entries[name] = &entry{revision: b.Revision, builtin: true, src: b}
			continue
		}
		p, err := policy.Compile(ctx, name, b)
		if err != nil {
			return nil, fmt.Errorf("built-in policy %s: %w", name, err)
		}
		s.entries[name] = compiledEntry(p, true, time.Time{})
	}
	des, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	for _, de := range des {
		name := de.Name()
		if !de.IsDir() || !nameRE.MatchString(name) {
			continue // leftovers of an interrupted apply are named .tmp-*
		}
		b, err := policy.LoadDir(filepath.Join(dir, name))
		if err != nil {
			return nil, fmt.Errorf("stored policy %s: %w", name, err)
		}
		p, err := policy.Compile(ctx, name, b)
		if err != nil {
			return nil, fmt.Errorf("stored policy %s: %w", name, err)
		}
		var appliedAt time.Time
		if fi, _ := de.Info(); fi != nil {
			appliedAt = fi.ModTime().UTC()
		}
		s.entries[name] = compiledEntry(p, s.entries[name] != nil, appliedAt)
	}
	return s, nil
}

// Get returns the policy called name.
func (s *Store) Get(name string) (*policy.Policy, error) {
	s.mu.RLock()
	e := s.entries[name]
	s.mu.RUnlock()
	if e == nil {
		return nil, fmt.Errorf("%w: %q", policy.ErrNoSuchPolicy, name)
	}
	return e.compiled(name)
}

// List describes every policy, by name.
func (s *Store) List() []Info {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make([]Info, 0, len(s.entries))
	for name, e := range s.entries {
		out = append(out, Info{Name: name, Revision: e.revision, Builtin: e.builtin, AppliedAt: e.appliedAt})
	}
	slices.SortFunc(out, func(a, b Info) int {
		switch {
		case a.Name < b.Name:
			return -1
		case a.Name > b.Name:
			return 1
		}
		return 0
	})
	return out
}

// Apply checks b (strict compile, required rules, its Rego tests) and only
// then stores it and makes it the policy called name. On any error the
// policy that served before keeps serving, unchanged on disk.
func (s *Store) Apply(ctx context.Context, name string, b *policy.Bundle) (*policy.Policy, []policy.TestResult, error) {
	if !nameRE.MatchString(name) {
		return nil, nil, fmt.Errorf("%w: %q (1-63 of a-z, 0-9 and '-', starting with a letter)", ErrInvalidName, name)
	}
	p, results, err := policy.Check(ctx, name, b)
	if err != nil {
		return nil, results, err
	}
	s.applyMu.Lock()
	defer s.applyMu.Unlock()
	// Write the new bundle beside the old, then swap directories: a crash
	// leaves either the old or the new one in place, plus a .tmp-* leftover.
	tmp, err := os.MkdirTemp(s.dir, ".tmp-"+name+"-")
	if err != nil {
		return nil, results, err
	}
	defer os.RemoveAll(tmp)
	staged := filepath.Join(tmp, "bundle")
	if err := b.WriteDir(staged); err != nil {
		return nil, results, fmt.Errorf("store policy %s: %w", name, err)
	}
	if err := syncTree(staged); err != nil {
		return nil, results, fmt.Errorf("store policy %s: %w", name, err)
	}
	final := filepath.Join(s.dir, name)
	old := filepath.Join(tmp, "old")
	if err := os.Rename(final, old); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, results, fmt.Errorf("store policy %s: %w", name, err)
	}
	if err := os.Rename(staged, final); err != nil {
		os.Rename(old, final) // put the old one back
		return nil, results, fmt.Errorf("store policy %s: %w", name, err)
	}
	if err := atomicfile.SyncDir(s.dir); err != nil {
		return nil, results, fmt.Errorf("store policy %s: %w", name, err)
	}

	s.mu.Lock()
	builtin := slices.Contains(policy.BuiltinNames(), name)
	s.entries[name] = compiledEntry(p, builtin, time.Now().UTC())
	s.mu.Unlock()
	s.log.Info("policy applied", "policy", name, "revision", p.Revision, "tests", len(results))
	return p, results, nil
}

// Decide evaluates in with the policy called name and records the
// decision. A missing policy, or a built-in one that fails to compile, is
// a deny, not a pass.
func (s *Store) Decide(ctx context.Context, name string, in policy.Input) (policy.Decision, error) {
	p, err := s.Get(name)
	var d policy.Decision
	if err != nil {
		d = policy.Decision{
			Time: time.Now().UTC(), Kind: in.Kind(), VM: in.VMName(), Policy: name,
			Rule: "carrel.no_such_policy", Reason: fmt.Sprintf("policy %q does not exist", name),
		}
		if !errors.Is(err, policy.ErrNoSuchPolicy) {
			d.Rule, d.Reason = "carrel.policy_not_compiled", err.Error()
		}
	} else {
		d, err = p.Decide(ctx, in)
	}
	if s.Record != nil {
		if rerr := s.Record(ctx, d, in); rerr != nil {
			d.Allow, d.Rule = false, "carrel.audit_unavailable"
			d.Reason = "the decision could not be recorded: " + rerr.Error()
			err = fmt.Errorf("%w: %w", ErrNotRecorded, rerr)
		}
	}
	s.decisions.add(d)
	if !d.Allow {
		s.log.Info("policy denied", "policy", d.Policy, "kind", d.Kind, "vm", d.VM, "rule", d.Rule, "reason", d.Reason, "decision", d.ID)
	}
	return d, err
}

// Recent returns up to limit recent decisions, oldest first, optionally
// only vm's and only denies.
func (s *Store) Recent(vm string, limit int, deniedOnly bool) []policy.Decision {
	return s.decisions.filter(func(d *policy.Decision) bool {
		return (vm == "" || d.VM == vm) && (!deniedOnly || !d.Allow)
	}, limit)
}

func syncTree(dir string) error {
	return filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		return errors.Join(f.Sync(), f.Close())
	})
}
