package activity

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/agentlink"
	"github.com/carrel-os/carrel/supervisor/audit"
)

// guest is an agent whose Activity calls are played by a script: each call
// runs the next function in streams (the last one again once they run
// out).
type guest struct {
	agentv1connect.UnimplementedAgentServiceHandler
	mu      sync.Mutex
	streams []func(ctx context.Context, send func(*agentv1.ActivityResponse) error) error
	calls   int
	starts  []time.Time   // when each call began
	called  chan struct{} // if set, told of each call (without blocking)
}

func (g *guest) Health(context.Context, *connect.Request[agentv1.HealthRequest]) (*connect.Response[agentv1.HealthResponse], error) {
	return connect.NewResponse(&agentv1.HealthResponse{Version: "test"}), nil
}

func (g *guest) Activity(ctx context.Context, _ *connect.Request[agentv1.ActivityRequest], s *connect.ServerStream[agentv1.ActivityResponse]) error {
	g.mu.Lock()
	i := min(g.calls, len(g.streams)-1)
	g.calls++
	g.starts = append(g.starts, time.Now())
	g.mu.Unlock()
	if g.called != nil {
		select {
		case g.called <- struct{}{}:
		default:
		}
	}
	return g.streams[i](ctx, s.Send)
}

func (g *guest) callCount() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.calls
}

// waitCalls waits until n calls have begun (g.called must be set) and
// returns when each began.
func (g *guest) waitCalls(t *testing.T, n int) []time.Time {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		g.mu.Lock()
		starts := slices.Clone(g.starts)
		g.mu.Unlock()
		if len(starts) >= n {
			return starts
		}
		select {
		case <-g.called:
		case <-deadline:
			t.Fatalf("%d Activity calls, want %d", len(starts), n)
		}
	}
}

// serveGuest serves g over a unix socket, as the agent serves the host,
// and returns a real link to it.
func serveGuest(t *testing.T, g *guest) *agentlink.Link {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "agent.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	mux := http2Mux(g)
	srv := protocol.NewHTTPServer(mux)
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	link := agentlink.New(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}, nil)
	t.Cleanup(func() { link.Close() })
	return link
}

// openLog opens a real audit log in a temporary directory.
func openLog(t *testing.T) (*audit.Log, string) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "audit")
	l, err := audit.Open(dir, audit.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l, dir
}

// records returns the log's file.activity records. The log may be
// appending meanwhile: a record still being written is left for the next
// read.
func records(t *testing.T, dir string) []audit.Record {
	t.Helper()
	var out []audit.Record
	_ = audit.Scan(dir, func(_ uint64, _ int64, p []byte) error {
		r, err := audit.Decode(p)
		if err != nil {
			t.Fatal(err)
		}
		if r.Kind == audit.KindFileActivity {
			out = append(out, r)
		}
		return nil
	})
	return out
}

func data(t *testing.T, r audit.Record) audit.Activity {
	t.Helper()
	var d audit.Activity
	dec := json.NewDecoder(strings.NewReader(string(r.Data)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&d); err != nil {
		t.Fatalf("record %d: %v: %s", r.Seq, err, r.Data)
	}
	return d
}

// totals sums the events and dropped counts of records.
func totals(t *testing.T, recs []audit.Record) (events []audit.ActivityEvent, dropped uint64) {
	for _, r := range recs {
		d := data(t, r)
		events = append(events, d.Events...)
		dropped += d.Dropped
	}
	return events, dropped
}

// waitRecords waits until cond holds of the log's activity records.
func waitRecords(t *testing.T, dir string, cond func([]audit.Record) bool) []audit.Record {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		recs := records(t, dir)
		if cond(recs) {
			return recs
		}
		if time.Now().After(deadline) {
			t.Fatalf("records never came; have %d", len(recs))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func ev(op agentv1.ActivityOp, p string) *agentv1.ActivityEvent {
	return &agentv1.ActivityEvent{Op: op, Path: p, Pid: 42, ExecId: "0123456789abcdef", AgeNs: 1000}
}

// sendThenWait sends msgs, then holds the stream open until ctx ends.
func sendThenWait(msgs ...*agentv1.ActivityResponse) func(context.Context, func(*agentv1.ActivityResponse) error) error {
	return func(ctx context.Context, send func(*agentv1.ActivityResponse) error) error {
		for _, m := range msgs {
			if err := send(m); err != nil {
				return err
			}
		}
		<-ctx.Done()
		return ctx.Err()
	}
}

// run starts c.Run and returns a function that stops it and returns its
// error.
func run(t *testing.T, c Config) func() error {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- c.Run(ctx) }()
	var once sync.Once
	var err error
	stop := func() error {
		once.Do(func() { cancel(); err = <-errc })
		return err
	}
	t.Cleanup(func() { stop() })
	return stop
}

// TestRunRecordsBatches checks that valid events are recorded as guest
// file.activity records of the VM and session, and that invalid ones are
// counted in dropped along with the guest's own count.
func TestRunRecordsBatches(t *testing.T) {
	g := &guest{streams: []func(context.Context, func(*agentv1.ActivityResponse) error) error{sendThenWait(
		&agentv1.ActivityResponse{Events: []*agentv1.ActivityEvent{
			ev(agentv1.ActivityOp_ACTIVITY_OP_CREATE, "/workspace/a"),
			ev(agentv1.ActivityOp_ACTIVITY_OP_MODIFY, "/workspace/a"),
			ev(agentv1.ActivityOp_ACTIVITY_OP_OPEN, "workspace/relative"),                // refused
			ev(agentv1.ActivityOp_ACTIVITY_OP_OPEN, "/workspace/../etc/shadow"),          // refused
			{Op: agentv1.ActivityOp(99), Path: "/x", Pid: 1, ExecId: "e"},                // refused
			{Op: agentv1.ActivityOp_ACTIVITY_OP_DELETE, Path: "/x", Pid: 0, ExecId: "e"}, // refused
		}, Dropped: 3},
		&agentv1.ActivityResponse{Events: []*agentv1.ActivityEvent{
			ev(agentv1.ActivityOp_ACTIVITY_OP_MOVE_FROM, "/workspace/a"),
			ev(agentv1.ActivityOp_ACTIVITY_OP_MOVE_TO, "/workspace/b"),
		}},
	)}}
	log, dir := openLog(t)
	stop := run(t, Config{Agent: serveGuest(t, g), Audit: log, VM: "vm1", Session: "ses_0123456789abcdef"})
	recs := waitRecords(t, dir, func(r []audit.Record) bool { return len(r) == 2 })
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	for _, r := range recs {
		if r.Provenance != audit.Guest || r.VM != "vm1" || r.Session != "ses_0123456789abcdef" {
			t.Errorf("record %d: provenance %q vm %q session %q", r.Seq, r.Provenance, r.VM, r.Session)
		}
	}
	d0, d1 := data(t, recs[0]), data(t, recs[1])
	want0 := []audit.ActivityEvent{
		{Op: "create", Path: "/workspace/a", PID: 42, ExecID: "0123456789abcdef", Ns: 1000},
		{Op: "modify", Path: "/workspace/a", PID: 42, ExecID: "0123456789abcdef", Ns: 1000},
	}
	if !equalEvents(d0.Events, want0) || d0.Dropped != 3+4 {
		t.Errorf("first record: %+v, want events %+v and dropped 7", d0, want0)
	}
	if len(d1.Events) != 2 || d1.Events[0].Op != "move_from" || d1.Events[1].Path != "/workspace/b" || d1.Dropped != 0 {
		t.Errorf("second record: %+v", d1)
	}
	if n := len(records(t, dir)); n != 2 {
		t.Errorf("%d records after Run ended, want 2 (nothing left to count)", n)
	}
}

func equalEvents(a, b []audit.ActivityEvent) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestRunSplitsLargeBatches checks that a message of long paths is split
// into records within the audit log's data cap, losing nothing.
func TestRunSplitsLargeBatches(t *testing.T) {
	const n = 100 // of 4 KiB each: within MaxMessageBytes
	msg := &agentv1.ActivityResponse{}
	long := "/workspace"
	for len(long) < 4000 {
		long += "/" + strings.Repeat("x", 200)
	}
	for range n {
		msg.Events = append(msg.Events, ev(agentv1.ActivityOp_ACTIVITY_OP_OPEN, long))
	}
	g := &guest{streams: []func(context.Context, func(*agentv1.ActivityResponse) error) error{sendThenWait(msg)}}
	log, dir := openLog(t)
	run(t, Config{Agent: serveGuest(t, g), Audit: log, VM: "big"})
	recs := waitRecords(t, dir, func(r []audit.Record) bool {
		got := 0
		for _, rec := range r {
			got += len(data(t, rec).Events)
		}
		return got >= n
	})
	if len(recs) < 2 {
		t.Fatalf("%d records for %d events of %d bytes; want them split", len(recs), n, len(long))
	}
	events, dropped := totals(t, recs)
	if len(events) != n || dropped != 0 {
		t.Errorf("recorded %d events, dropped %d; want %d and 0", len(events), dropped, n)
	}
	for _, r := range recs {
		if len(r.Data) > audit.MaxDataSize {
			t.Errorf("record %d has %d bytes of data", r.Seq, len(r.Data))
		}
	}
}

// TestRunHoldsTheVMToItsBudget checks that events over the rate are
// counted in dropped, not recorded.
func TestRunHoldsTheVMToItsBudget(t *testing.T) {
	var msgs []*agentv1.ActivityResponse
	for range 4 {
		m := &agentv1.ActivityResponse{}
		for range 50 {
			m.Events = append(m.Events, ev(agentv1.ActivityOp_ACTIVITY_OP_MODIFY, "/workspace/f"))
		}
		msgs = append(msgs, m)
	}
	g := &guest{streams: []func(context.Context, func(*agentv1.ActivityResponse) error) error{
		func(_ context.Context, send func(*agentv1.ActivityResponse) error) error {
			for _, m := range msgs {
				if err := send(m); err != nil {
					return err
				}
			}
			return nil // the host reads all four before it reopens
		},
		sendThenWait(),
	}}
	log, dir := openLog(t)
	// 30 events (and 3 records) a second, at most a second's worth at once.
	stop := run(t, Config{Agent: serveGuest(t, g), Audit: log, VM: "greedy", Rate: 30, RecordRate: 3, Window: time.Second,
		MinBackoff: 10 * time.Millisecond})
	deadline := time.Now().Add(10 * time.Second)
	for g.callCount() < 2 {
		if time.Now().After(deadline) {
			t.Fatal("the stream was not reopened")
		}
		time.Sleep(10 * time.Millisecond)
	}
	stop() // records the count of what was lost
	events, dropped := totals(t, records(t, dir))
	if len(events) > 40 || len(events) < 30 {
		t.Errorf("recorded %d events; want about 30 (the budget)", len(events))
	}
	if uint64(len(events))+dropped != 200 {
		t.Errorf("recorded %d and dropped %d; want them to add up to the 200 sent", len(events), dropped)
	}
}

// TestRunReopensTheStream checks that a stream that ends (the guest
// restarted, say) is reopened after a backoff, and that a message over
// the cap on events or on bytes ends a stream without being recorded.
func TestRunReopensTheStream(t *testing.T) {
	tooMany, tooBig := &agentv1.ActivityResponse{}, &agentv1.ActivityResponse{}
	for range MaxEvents + 1 {
		tooMany.Events = append(tooMany.Events, ev(agentv1.ActivityOp_ACTIVITY_OP_OPEN, "/workspace/many"))
	}
	for range 200 { // 800 KB: under the link's cap, over MaxMessageBytes
		tooBig.Events = append(tooBig.Events, ev(agentv1.ActivityOp_ACTIVITY_OP_OPEN, "/workspace/"+strings.Repeat("b", 4000)))
	}
	g := &guest{streams: []func(context.Context, func(*agentv1.ActivityResponse) error) error{
		func(_ context.Context, send func(*agentv1.ActivityResponse) error) error {
			send(&agentv1.ActivityResponse{Events: []*agentv1.ActivityEvent{ev(agentv1.ActivityOp_ACTIVITY_OP_CREATE, "/workspace/one")}})
			return connect.NewError(connect.CodeAborted, errors.New("agent restarting"))
		},
		sendThenWait(tooMany),
		sendThenWait(tooBig),
		sendThenWait(&agentv1.ActivityResponse{Events: []*agentv1.ActivityEvent{ev(agentv1.ActivityOp_ACTIVITY_OP_CREATE, "/workspace/two")}}),
	}}
	log, dir := openLog(t)
	run(t, Config{Agent: serveGuest(t, g), Audit: log, VM: "flaky", MinBackoff: 10 * time.Millisecond})
	recs := waitRecords(t, dir, func(r []audit.Record) bool { return len(r) >= 2 })
	events, _ := totals(t, recs)
	var paths []string
	for _, e := range events {
		paths = append(paths, e.Path)
	}
	if strings.Join(paths, " ") != "/workspace/one /workspace/two" {
		t.Errorf("recorded %v; want one, then two (nothing of the oversized messages)", paths)
	}
	if n := g.callCount(); n < 4 {
		t.Errorf("%d Activity calls, want 4", n)
	}
}

// TestRunStopsForAnOldAgent checks that Run gives up on an agent that has
// no Activity call.
func TestRunStopsForAnOldAgent(t *testing.T) {
	g := &guest{streams: []func(context.Context, func(*agentv1.ActivityResponse) error) error{
		func(context.Context, func(*agentv1.ActivityResponse) error) error {
			return connect.NewError(connect.CodeUnimplemented, errors.New("no activity here"))
		},
	}}
	log, _ := openLog(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := Config{Agent: serveGuest(t, g), Audit: log, VM: "old", MinBackoff: time.Millisecond}.Run(ctx)
	if !errors.Is(err, ErrUnsupported) {
		t.Fatalf("Run: %v, want ErrUnsupported", err)
	}
}

// TestRunEndsAFloodOfMessages checks that a guest sending empty messages
// as fast as it can has its stream ended, and that Run backs off.
func TestRunEndsAFloodOfMessages(t *testing.T) {
	g := &guest{called: make(chan struct{}, 1), streams: []func(context.Context, func(*agentv1.ActivityResponse) error) error{
		func(ctx context.Context, send func(*agentv1.ActivityResponse) error) error {
			for ctx.Err() == nil {
				if err := send(&agentv1.ActivityResponse{}); err != nil {
					return err
				}
			}
			return ctx.Err()
		},
	}}
	log, _ := openLog(t)
	run(t, Config{Agent: serveGuest(t, g), Audit: log, VM: "flood", RecordRate: 5, Window: time.Second,
		MinBackoff: 100 * time.Millisecond, MaxBackoff: time.Second})
	// 20 messages a second are allowed; each stream is ended within the
	// budget (else no next call begins) and the next waits 100 ms, 200 ms,
	// 400 ms...
	starts := g.waitCalls(t, 4)
	backoff := 100 * time.Millisecond
	for i := 1; i < len(starts); i++ {
		if gap := starts[i].Sub(starts[i-1]); gap < backoff {
			t.Errorf("call %d began %v after the one before; want a backoff of at least %v", i+1, gap, backoff)
		}
		backoff *= 2
	}
}

func http2Mux(g *guest) *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle(agentv1connect.NewAgentServiceHandler(g, protocol.HandlerOptions()...))
	return mux
}
