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
