package policies

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/policy"
)

func TestCheckSandboxReply(t *testing.T) {
	for _, c := range []struct {
		name     string
		in       *agentv1.SetSandboxResponse
		landlock bool
		abi      int32
		detail   string
	}{
		{"fine", &agentv1.SetSandboxResponse{Landlock: true, LandlockAbi: 2}, true, 2, ""},
		{"landlock with no abi", &agentv1.SetSandboxResponse{Landlock: true}, false, 0, ""},
		{"absurd abi", &agentv1.SetSandboxResponse{Landlock: true, LandlockAbi: 1 << 30}, false, 0, ""},
		{"negative abi", &agentv1.SetSandboxResponse{Landlock: true, LandlockAbi: -1}, false, 0, ""},
		{"escapes", &agentv1.SetSandboxResponse{Detail: "\x1b[31mred\x00\n\xff"}, false, 0, "[31mred"},
		{"huge", &agentv1.SetSandboxResponse{Detail: strings.Repeat("é", 1<<20)}, false, 0, strings.Repeat("é", maxSandboxDetail/2)},
		{"nil", nil, false, 0, ""},
	} {
		l, abi, d := checkSandboxReply(c.in)
		if l != c.landlock || abi != c.abi || d != c.detail {
			t.Errorf("%s: %v %d %q", c.name, l, abi, d)
		}
	}
}

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
