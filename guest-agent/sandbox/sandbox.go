//go:build linux

// Package sandbox is the guest's own file-system sandbox: defence in depth
// behind the host, which checks every call against the VM's policy before
// forwarding it.
//
// carreld sends a Policy (SetSandbox): read-write roots, read-only roots
// and denied (secret) paths. A Guard holds the sandbox in force and swaps
// it atomically. Two parts of the agent consult it:
//
//   - Commands. Guard.Spawn starts every command the agent runs on a fresh
//     OS thread that sets no_new_privs and, when a sandbox is set and the
//     kernel has Landlock, enters a Landlock domain that allows the roots
//     (and the devices and /proc a process needs). The child inherits both;
//     the agent never does (see thread.go).
//   - The file service, which resolves each path against the root it lies
//     under (Sandbox.RootOf), refuses secret paths (Sandbox.DeniedAt), and
//     does the operation through an os.Root so that no symlink leads out.
//
// Before the first Policy there is no sandbox: commands still get
// no_new_privs, and the file service works on the whole file system.
package sandbox

import (
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
)

const (
	// MaxPaths caps each list of a Policy.
	MaxPaths = 256
	// MaxPathBytes caps each path of a Policy, and its revision.
	MaxPathBytes = 4096
)

var (
	// ErrInvalid marks a Policy that fails validation.
	ErrInvalid = errors.New("invalid sandbox")
	// ErrRefused marks an operation the sandbox does not allow.
	ErrRefused = errors.New("refused by the guest sandbox")
)

// Policy is what the host asks the sandbox to allow.
type Policy struct {
	// ReadWrite roots allow everything beneath them.
	ReadWrite []string
	// ReadOnly roots allow reading, listing, watching and executing.
	ReadOnly []string
	// Denied are secret paths, files or directories, that the file
	// service refuses even beneath a root. Landlock cannot express them.
	Denied []string
	// Revision names the policy the sandbox came from, for logs.
	Revision string
}

// Validate checks that every path is absolute, clean, free of NUL and at
// most MaxPathBytes long, and that no list has more than MaxPaths entries.
// Errors wrap ErrInvalid and name the offending entry.
func (p Policy) Validate() error {
	if len(p.Revision) > MaxPathBytes {
		return fmt.Errorf("%w: revision is %d bytes, more than %d", ErrInvalid, len(p.Revision), MaxPathBytes)
	}
	for _, l := range []struct {
		name  string
		paths []string
	}{{"read_write", p.ReadWrite}, {"read_only", p.ReadOnly}, {"denied", p.Denied}} {
		if len(l.paths) > MaxPaths {
			return fmt.Errorf("%w: %s has %d entries, more than %d", ErrInvalid, l.name, len(l.paths), MaxPaths)
		}
		for i, path := range l.paths {
			if err := checkPath(path); err != nil {
				return fmt.Errorf("%w: %s[%d] %q: %v", ErrInvalid, l.name, i, truncate(path), err)
			}
		}
	}
	return nil
}

func checkPath(p string) error {
	switch {
	case p == "":
		return errors.New("empty path")
	case len(p) > MaxPathBytes:
		return fmt.Errorf("%d bytes, more than %d", len(p), MaxPathBytes)
	case strings.IndexByte(p, 0) >= 0:
		return errors.New("contains NUL")
	case !filepath.IsAbs(p):
		return errors.New("not absolute")
	case filepath.Clean(p) != p:
		return fmt.Errorf("not clean (%q)", truncate(filepath.Clean(p)))
	}
	return nil
}

func truncate(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}

// Under reports whether p is root or lies beneath it, comparing whole path
// components: /workspacex is not under /workspace. Both must be clean.
func Under(p, root string) bool {
	return p == root || root == "/" || (strings.HasPrefix(p, root) && p[len(root)] == '/')
}

// Root is one root of a sandbox.
type Root struct {
	Path     string
	Writable bool
}

// Sandbox is a Policy in force. It is immutable, and safe for concurrent
// use.
type Sandbox struct {
	policy Policy
	roots  []Root   // longest path first; read-write before read-only on a tie
	denied []string // as given, and as the file system resolves them
	rules  *ruleset // nil without Landlock
}

// Policy returns the policy the sandbox enforces.
func (s *Sandbox) Policy() Policy { return s.policy }

// Landlock reports whether commands run inside a Landlock domain.
func (s *Sandbox) Landlock() bool { return s.rules != nil }

// RootOf returns the root p lies under: the longest one, by whole path
// components. Where a path is both a read-write and a read-only root, the
// read-write one wins. p must be clean.
func (s *Sandbox) RootOf(p string) (Root, bool) {
	for _, r := range s.roots {
		if Under(p, r.Path) {
			return r, true
		}
	}
	return Root{}, false
}

// DeniedAt returns the denied path p is, or lies beneath.
func (s *Sandbox) DeniedAt(p string) (string, bool) {
	for _, d := range s.denied {
		if Under(p, d) {
			return d, true
		}
	}
	return "", false
}

// DeniedBeneath returns a denied path that lies strictly beneath p: an
// operation on the whole tree at p (remove, rename, extract) would reach
// it.
func (s *Sandbox) DeniedBeneath(p string) (string, bool) {
	for _, d := range s.denied {
		if d != p && Under(d, p) {
			return d, true
		}
	}
	return "", false
}

// newSandbox builds the path tables of a validated policy.
func newSandbox(p Policy) *Sandbox {
	s := &Sandbox{policy: p}
	for _, r := range p.ReadWrite {
		s.roots = append(s.roots, Root{Path: r, Writable: true})
	}
	for _, r := range p.ReadOnly {
		s.roots = append(s.roots, Root{Path: r})
	}
	slices.SortStableFunc(s.roots, func(a, b Root) int {
		if len(a.Path) != len(b.Path) {
			return len(b.Path) - len(a.Path)
		}
		if a.Writable != b.Writable {
			if a.Writable {
				return -1
			}
			return 1
		}
		return 0
	})
	// The file service compares paths as the kernel resolved them too, so
	// a denied path reached through a symlink is still refused.
	for _, d := range p.Denied {
		s.denied = append(s.denied, d)
		if r := resolve(d); r != d {
			s.denied = append(s.denied, r)
		}
	}
	return s
}

// resolve returns p with its symlinks resolved, as far as it exists.
func resolve(p string) string {
	q, rest := p, ""
	for {
		if r, err := filepath.EvalSymlinks(q); err == nil {
			return filepath.Join(r, rest)
		}
		if q == "/" {
			return p
		}
		q, rest = filepath.Dir(q), filepath.Join(filepath.Base(q), rest)
	}
}

// Status is what setting a sandbox achieved.
type Status struct {
	// Landlock is set when commands started from now on run inside a
	// Landlock domain.
	Landlock bool
	// ABI is the kernel's Landlock ABI version, 0 without Landlock.
	ABI int
	// Detail says, in words, what is and is not enforced.
	Detail string
}

// Guard holds the sandbox in force. The zero value has none; a nil *Guard
// behaves like one that never gets one.
type Guard struct {
	// Log receives a warning whenever a sandbox goes into force without
	// Landlock; nil means slog.Default().
	Log *slog.Logger

	mu  sync.Mutex // serialises Set
	cur atomic.Pointer[Sandbox]

	spawnMu sync.Mutex // serialises Spawn
	spawner *spawner   // the thread that forks under cur, once made
}

// Current returns the sandbox in force, or nil before the first Set.
func (g *Guard) Current() *Sandbox {
	if g == nil {
		return nil
	}
	return g.cur.Load()
}

// Set validates p and puts it in force in place of the previous sandbox,
// atomically: commands started and file operations begun from then on see
// the new one. An invalid policy (an error wrapping ErrInvalid) or a
// failure to build its Landlock ruleset leaves the previous sandbox in
// force. Without Landlock, the sandbox still goes into force (for the file
// service), Status says why Landlock is missing, and a warning is logged:
// the guest never runs unconfined without saying so. Set on a nil Guard
// fails.
func (g *Guard) Set(p Policy) (Status, error) {
	if g == nil {
		return Status{}, errors.New("sandbox: no guard to set")
	}
	if err := p.Validate(); err != nil {
		return Status{}, err
	}
	g.mu.Lock() // the last Set to start is the one in force
	defer g.mu.Unlock()
	p = Policy{
		ReadWrite: slices.Clone(p.ReadWrite),
		ReadOnly:  slices.Clone(p.ReadOnly),
		Denied:    slices.Clone(p.Denied),
		Revision:  p.Revision,
	}
	sb := newSandbox(p)
	rules, st, err := buildRuleset(p.ReadWrite, p.ReadOnly)
	if err != nil {
		return Status{}, fmt.Errorf("sandbox: landlock: %w", err)
	}
	sb.rules = rules
	old := g.cur.Swap(sb)
	if old != nil && old.rules != nil {
		old.rules.close() // waits for any command entering it right now
	}
	if !st.Landlock {
		g.log().Warn("guest sandbox without Landlock: commands run with no_new_privs only; the file service still enforces the roots",
			"revision", p.Revision, "landlock_abi", st.ABI, "detail", st.Detail)
	}
	return st, nil
}

func (g *Guard) log() *slog.Logger {
	if g.Log != nil {
		return g.Log
	}
	return slog.Default()
}
