package policystore

import (
	"context"
	"errors"
	"testing"

	"github.com/carrel-os/carrel/policy"
)

// TestDecideFailsClosed: a missing policy and an unrecordable decision are
// both denies.
func TestDecideFailsClosed(t *testing.T) {
	ctx := context.Background()
	s, err := Open(ctx, t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	in := &policy.FSInput{Caller: policy.Caller{Type: policy.CallerPeer}, VM: "a", Operation: policy.OpRead, Path: "/workspace/x"}
	if d, _ := s.Decide(ctx, "nope", in); d.Allow || d.Rule != "carrel.no_such_policy" {
		t.Errorf("missing policy: %+v", d)
	}
	if d, err := s.Decide(ctx, policy.DefaultName, in); err != nil || !d.Allow {
		t.Fatalf("default read of /workspace/x: %+v %v", d, err)
	}
	s.Record = func(context.Context, policy.Decision, policy.Input) error { return errors.New("disk full") }
	d, err := s.Decide(ctx, policy.DefaultName, in)
	if d.Allow || !errors.Is(err, ErrNotRecorded) || d.Rule != "carrel.audit_unavailable" {
		t.Errorf("unrecorded decision: %+v %v", d, err)
	}
}

// TestBuiltinExamplesCompiledOnFirstUse: only the default policy is
// compiled at Open; an example is listed with its revision all the same,
// and compiled once, when first used.
func TestBuiltinExamplesCompiledOnFirstUse(t *testing.T) {
	ctx := context.Background()
	s, err := Open(ctx, t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range policy.BuiltinNames() {
		if compiled := s.entries[name].pol != nil; compiled != (name == policy.DefaultName) {
			t.Errorf("%s compiled at Open: %v", name, compiled)
		}
	}
	const name = "analyst"
	b, err := policy.Builtin(name)
	if err != nil {
		t.Fatal(err)
	}
	var listed string
	for _, info := range s.List() {
		if info.Name == name {
			listed = info.Revision
		}
	}
	if listed != b.Revision {
		t.Errorf("%s listed with revision %q, want %q", name, listed, b.Revision)
	}
	if s.entries[name].pol != nil {
		t.Fatalf("List compiled %s", name)
	}
	p, err := s.Get(name)
	if err != nil || p.Revision != b.Revision {
		t.Fatalf("Get(%s): %v, %v", name, p, err)
	}
	if again, _ := s.Get(name); again != p {
		t.Errorf("Get(%s) compiled it again", name)
	}
	in := &policy.FSInput{Caller: policy.Caller{Type: policy.CallerPeer}, VM: "a", Operation: policy.OpRead, Path: "/workspace/x"}
	if d, err := s.Decide(ctx, name, in); err != nil || d.Revision != b.Revision {
		t.Errorf("Decide with %s: %+v %v", name, d, err)
	}
}
