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
	"google.golang.org/protobuf/proto"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/supervisor/driver/drivertest"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
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
		batch := make([]*agentv1.WatchEvent, maxWatchBatch)
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
		return s.Send(&agentv1.WatchResponse{Events: make([]*agentv1.WatchEvent, maxWatchBatch+1)})
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
		return one(event(agentv1.WatchOp_WATCH_OP_CREATE, "/long/"+strings.Repeat("x", maxPathBytes)))
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
		if !errors.As(err, &ce) || ce.Code() != connect.CodeResourceExhausted || !strings.Contains(ce.Message(), ErrWatchRate.Error()) {
			t.Errorf("watch %s: %v, want ResourceExhausted: %v", p, err, ErrWatchRate)
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
	if r := h.rate.Load(); r != defaultWatchRate {
		t.Errorf("asked the guest for %d events a second, want the default %d", r, defaultWatchRate)
	}
	if _, err := watch("/", true, 1<<30); err != nil {
		t.Errorf("watch /: %v", err)
	}
	if r := h.rate.Load(); r != maxWatchRate {
		t.Errorf("asked the guest for %d events a second, want the cap %d", r, maxWatchRate)
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

func TestBucket(t *testing.T) {
	t0 := time.Unix(1000, 0)
	b := newBucket(10, 2*time.Second, t0) // 20 at most
	if !b.take(t0, 20) || b.take(t0, 1) {
		t.Fatal("a full bucket holds 20")
	}
	if !b.take(t0.Add(time.Second), 10) || b.take(t0.Add(time.Second), 1) {
		t.Fatal("a second refills 10")
	}
	if !b.take(t0.Add(time.Hour), 20) || b.take(t0.Add(time.Hour), 1) {
		t.Fatal("refills stop at the cap")
	}
	// Waiting on a client earns credit beyond the cap, kept by refills.
	b.credit(5 * time.Second)
	if !b.take(t0.Add(2*time.Hour), 50) || b.take(t0.Add(2*time.Hour), 1) {
		t.Fatal("credit beyond the cap was lost")
	}
}

// FuzzCheckWatch feeds arbitrary guest bytes, decoded as a WatchResponse,
// to the check every relayed watch message passes: whatever it accepts
// must be sane.
func FuzzCheckWatch(f *testing.F) {
	ok := &agentv1.WatchResponse{Dropped: 3, Events: []*agentv1.WatchEvent{
		event(agentv1.WatchOp_WATCH_OP_CREATE, "/w/a"),
		{Op: agentv1.WatchOp_WATCH_OP_RENAME, Path: "/w/b/c", OldPath: "/w/d", IsDir: true},
	}}
	bad := &agentv1.WatchResponse{Events: []*agentv1.WatchEvent{event(agentv1.WatchOp_WATCH_OP_DELETE, "/w/../x")}}
	for _, m := range []*agentv1.WatchResponse{ok, bad} {
		b, _ := proto.Marshal(m)
		f.Add(b, true)
		f.Add(b, false)
	}
	f.Fuzz(func(t *testing.T, b []byte, recursive bool) {
		var m agentv1.WatchResponse
		if proto.Unmarshal(b, &m) != nil {
			return
		}
		const root = "/w"
		if checkWatch(root, recursive, &m) != nil {
			return
		}
		if len(m.Events) > maxWatchBatch {
			t.Fatalf("accepted %d events", len(m.Events))
		}
		sane := func(p string) bool {
			return len(p) <= maxPathBytes && !strings.ContainsRune(p, 0) && path.Clean(p) == p &&
				(p == root || strings.HasPrefix(p, root+"/")) && (recursive || p == root || path.Dir(p) == root)
		}
		for _, e := range m.Events {
			rename := e.Op == agentv1.WatchOp_WATCH_OP_RENAME
			if !sane(e.Path) || (rename && !sane(e.OldPath)) || (!rename && e.OldPath != "") {
				t.Fatalf("accepted %v", e)
			}
			if _, known := agentv1.WatchOp_name[int32(e.Op)]; !known || e.Op == agentv1.WatchOp_WATCH_OP_UNSPECIFIED {
				t.Fatalf("accepted op %d", e.Op)
			}
		}
	})
}
