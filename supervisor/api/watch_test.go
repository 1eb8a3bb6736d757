package api

import (
	"context"
	"errors"
	"path"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/supervisor/driver/drivertest"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
	"github.com/carrel-os/carrel/supervisor/relay"
)

// hostileWatch breaks every rule a guest's watch can break, by path.
type hostileWatch struct {
	hostileFiles
	// rate is the last rate the relay asked for.
	rate atomic.Uint32
}

func event(op agentv1.WatchOp, p string) *agentv1.WatchEvent {
	return &agentv1.WatchEvent{Op: op, Path: p, TimeUnixNano: 1}
}

func (h *hostileWatch) Watch(ctx context.Context, req *connect.Request[agentv1.WatchRequest], s *connect.ServerStream[agentv1.WatchResponse]) error {
	h.rate.Store(req.Msg.MaxEventsPerSecond)
	root := req.Msg.Path
	one := func(e *agentv1.WatchEvent) error {
		return s.Send(&agentv1.WatchResponse{Events: []*agentv1.WatchEvent{e}})
	}
	switch root {
	case "/flood":
		batch := make([]*agentv1.WatchEvent, relay.MaxWatchBatch)
		for i := range batch {
			batch[i] = event(agentv1.WatchOp_WATCH_OP_MODIFY, "/flood/f")
		}
		for ctx.Err() == nil {
			if err := s.Send(&agentv1.WatchResponse{Events: batch}); err != nil {
				return err
			}
		}
		return nil
	case "/chatter":
		for ctx.Err() == nil {
			if err := s.Send(&agentv1.WatchResponse{}); err != nil {
				return err
			}
		}
		return nil
	case "/toomany":
		return s.Send(&agentv1.WatchResponse{Events: make([]*agentv1.WatchEvent, relay.MaxWatchBatch+1)})
	case "/outside":
		return one(event(agentv1.WatchOp_WATCH_OP_CREATE, "/etc/passwd"))
	case "/prefix":
		return one(event(agentv1.WatchOp_WATCH_OP_CREATE, "/prefixed/x"))
	case "/unclean":
		return one(event(agentv1.WatchOp_WATCH_OP_CREATE, "/unclean/../etc/passwd"))
	case "/relative":
		return one(event(agentv1.WatchOp_WATCH_OP_CREATE, "relative/x"))
	case "/nul":
		return one(event(agentv1.WatchOp_WATCH_OP_CREATE, "/nul/a\x00b"))
	case "/long":
		return one(event(agentv1.WatchOp_WATCH_OP_CREATE, "/long/"+strings.Repeat("x", relay.MaxPathBytes)))
	case "/badop":
		return one(event(99, "/badop/x"))
	case "/noop":
		return one(event(agentv1.WatchOp_WATCH_OP_UNSPECIFIED, "/noop/x"))
	case "/oldpath":
		e := event(agentv1.WatchOp_WATCH_OP_CREATE, "/oldpath/x")
		e.OldPath = "/oldpath/y"
		return one(e)
	case "/renamefrom":
		e := event(agentv1.WatchOp_WATCH_OP_RENAME, "/renamefrom/x")
		e.OldPath = "/etc/shadow"
		return one(e)
	case "/shallow":
		// Below a child: only a recursive watch reports that.
		return one(event(agentv1.WatchOp_WATCH_OP_CREATE, "/shallow/a/b"))
	}
	// A well-behaved guest.
	rename := event(agentv1.WatchOp_WATCH_OP_RENAME, path.Join(root, "new"))
	rename.OldPath = path.Join(root, "old")
	s.Send(&agentv1.WatchResponse{})
	return s.Send(&agentv1.WatchResponse{Dropped: 5, UnwatchedDirs: 2, Events: []*agentv1.WatchEvent{
		event(agentv1.WatchOp_WATCH_OP_CREATE, root), rename, event(agentv1.WatchOp_WATCH_OP_DELETE, path.Join(root, "a")),
	}})
}

func TestWatchRelayRejectsHostileGuests(t *testing.T) {
	sock, drv := serveAPIWith(t)
	h := &hostileWatch{}
	drv.SetNext(drivertest.Behavior{Files: h})
	c := client.New(sock)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := c.VMs.CreateVM(ctx, connect.NewRequest(&apiv1.CreateVMRequest{Name: "evil", Image: "dev"})); err != nil {
		t.Fatal(err)
	}
	watch := func(p string, recursive bool, rate uint32) ([]*agentv1.WatchResponse, error) {
		var got []*agentv1.WatchResponse
		err := c.Watch(ctx, "evil", p, client.WatchOptions{Recursive: recursive, MaxEventsPerSecond: rate}, func(m *agentv1.WatchResponse) error {
			got = append(got, m)
			return nil
		})
		return got, err
	}

	for _, p := range []string{"/toomany", "/outside", "/prefix", "/unclean", "/relative", "/nul", "/long", "/badop", "/noop", "/oldpath", "/renamefrom", "/shallow"} {
		got, err := watch(p, p != "/shallow", 0)
		if connect.CodeOf(err) != connect.CodeDataLoss || len(got) != 0 {
			t.Errorf("watch %s: %d messages passed, err %v; want none and DataLoss", p, len(got), err)
		}
	}
	if _, err := watch("/shallow", true, 0); err != nil {
		t.Errorf("recursive watch reporting below a child: %v", err)
	}

	// Floods end the stream with a clear error, soon.
	start := time.Now()
	for _, p := range []string{"/flood", "/chatter"} {
		got, err := watch(p, true, 10)
		var ce *connect.Error
		if !errors.As(err, &ce) || ce.Code() != connect.CodeResourceExhausted || !strings.Contains(ce.Message(), relay.ErrWatchRate.Error()) {
			t.Errorf("watch %s: %v, want ResourceExhausted: %v", p, err, relay.ErrWatchRate)
		}
		n := 0
		for _, m := range got {
			n += len(m.Events)
		}
		if n > 100 {
			t.Errorf("watch %s at 10 a second passed %d events", p, n)
		}
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("floods took %v to stop", d)
	}

	// A well-behaved guest's messages pass whole.
	got, err := watch("/w/", false, 0)
	if err != nil || len(got) != 2 {
		t.Fatalf("valid watch: %v, %v", got, err)
	}
	if m := got[1]; m.Dropped != 5 || m.UnwatchedDirs != 2 || len(m.Events) != 3 || m.Events[1].OldPath != "/w/old" {
		t.Errorf("relayed %v", m)
	}
	if r := h.rate.Load(); r != relay.DefaultWatchRate {
		t.Errorf("asked the guest for %d events a second, want the default %d", r, relay.DefaultWatchRate)
	}
	if _, err := watch("/", true, 1<<30); err != nil {
		t.Errorf("watch /: %v", err)
	}
	if r := h.rate.Load(); r != relay.MaxWatchRate {
		t.Errorf("asked the guest for %d events a second, want the cap %d", r, relay.MaxWatchRate)
	}
	for _, p := range []string{"relative", "", "/a\x00b"} {
		if _, err := watch(p, true, 0); connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("watch %q: %v, want InvalidArgument", p, err)
		}
	}
	// The link survives: these were the guest's words, not a broken stream.
	if _, err := c.Stat(ctx, "evil", "/still-there"); err != nil {
		t.Errorf("after hostile watches: %v", err)
	}
}
