//go:build linux

package server

import (
	"context"
	"testing"

	"connectrpc.com/connect"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

// TestActivityRelaysTheFeed checks that the Activity call streams what
// Config.Activity sends, and fails with CodeUnimplemented without one.
func TestActivityRelaysTheFeed(t *testing.T) {
	f := serve(t)
	s, err := f.client.Activity(callCtx(t), connect.NewRequest(&agentv1.ActivityRequest{}))
	if err == nil {
		for s.Receive() {
		}
		err = s.Err()
	}
	if connect.CodeOf(err) != connect.CodeUnimplemented {
		t.Errorf("Activity with no feed: %v, want CodeUnimplemented", err)
	}

	want := &agentv1.ActivityResponse{Dropped: 2, Events: []*agentv1.ActivityEvent{
		{Op: agentv1.ActivityOp_ACTIVITY_OP_CREATE, Path: "/workspace/a", Pid: 7, ExecId: "0123456789abcdef", AgeNs: 5},
	}}
	f = serve(t, func(c *Config) {
		c.Activity = func(ctx context.Context, send func(*agentv1.ActivityResponse) error) error {
			if err := send(want); err != nil {
				return err
			}
			<-ctx.Done()
			return ctx.Err()
		}
	})
	ctx, cancel := context.WithCancel(callCtx(t))
	defer cancel()
	s, err = f.client.Activity(ctx, connect.NewRequest(&agentv1.ActivityRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if !s.Receive() {
		t.Fatalf("no message: %v", s.Err())
	}
	got := s.Msg()
	if got.Dropped != 2 || len(got.Events) != 1 || got.Events[0].Path != "/workspace/a" || got.Events[0].ExecId != want.Events[0].ExecId {
		t.Errorf("got %v, want %v", got, want)
	}
}
