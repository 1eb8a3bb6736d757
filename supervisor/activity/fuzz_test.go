package activity

import (
	"context"
	"encoding/json"
	"path"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"google.golang.org/protobuf/proto"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/audit"
)

// memRecorder keeps records in memory.
type memRecorder struct{ recs []audit.Record }

func (m *memRecorder) Append(_ context.Context, r audit.Record) (uint64, error) {
	m.recs = append(m.recs, r)
	return uint64(len(m.recs) - 1), nil
}

// FuzzMessage feeds the checks and the recording arbitrary bytes as an
// ActivityResponse from a guest. Whatever the guest sends, every event
// recorded is valid, every record's data is JSON within the cap, and the
// events recorded and the dropped counts add up to what was sent.
func FuzzMessage(f *testing.F) {
	seed := func(m *agentv1.ActivityResponse) {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	seed(&agentv1.ActivityResponse{})
	seed(&agentv1.ActivityResponse{Dropped: ^uint64(0), Events: []*agentv1.ActivityEvent{ev(agentv1.ActivityOp_ACTIVITY_OP_OPEN, "/workspace/a")}})
	seed(&agentv1.ActivityResponse{Events: []*agentv1.ActivityEvent{
		ev(agentv1.ActivityOp_ACTIVITY_OP_CREATE, "/workspace/a"),
		ev(agentv1.ActivityOp_ACTIVITY_OP_DELETE, "/workspace/../a"),
		ev(agentv1.ActivityOp_ACTIVITY_OP_MOVE_TO, "/workspace/\x01<&>\"\\"),
		{Op: agentv1.ActivityOp_ACTIVITY_OP_MOVE_FROM, Path: "/w", Pid: -1, ExecId: "x", AgeNs: -5},
		{Op: 7, Path: "/w", Pid: 3, ExecId: "x"},
		{Op: agentv1.ActivityOp_ACTIVITY_OP_MODIFY, Path: "/" + strings.Repeat("\x7f", MaxPathBytes-1), Pid: 3, ExecId: "a-b_C"},
		{Op: agentv1.ActivityOp_ACTIVITY_OP_MODIFY, Path: "/w", Pid: 3, ExecId: strings.Repeat("a", 65)},
	}})
	f.Fuzz(func(t *testing.T, b []byte) {
		var msg agentv1.ActivityResponse
		if err := proto.Unmarshal(b, &msg); err != nil {
			return
		}
		c, err := check(&msg)
		if len(msg.Events) > MaxEvents || proto.Size(&msg) > MaxMessageBytes {
			if err == nil {
				t.Fatalf("%d events, %d bytes accepted", len(msg.Events), proto.Size(&msg))
			}
			return
		}
		if err != nil {
			t.Fatalf("check: %v", err)
		}
		for _, e := range c.events {
			if !validEvent(e) {
				t.Fatalf("invalid event kept: %+v", e)
			}
		}
		if msg.Dropped < 1<<62 && c.dropped-msg.Dropped+uint64(len(c.events)) != uint64(len(msg.Events)) {
			t.Fatalf("%d events sent, %d kept, %d more dropped", len(msg.Events), len(c.events), c.dropped-msg.Dropped)
		}

		mem := &memRecorder{}
		r := &recorder{cfg: Config{Audit: mem, VM: "v"}.withDefaults(), budget: newBudget(Config{Rate: 1e9, RecordRate: 1e9, Window: time.Second}, time.Now())}
		r.log = r.cfg.Log
		if err := r.message(context.Background(), &msg); err != nil {
			t.Fatalf("message: %v", err)
		}
		var recorded int
		var dropped uint64
		for _, rec := range mem.recs {
			if rec.Kind != audit.KindFileActivity || rec.Provenance != audit.Guest || len(rec.Data) > audit.MaxDataSize {
				t.Fatalf("record %+v (%d bytes of data)", rec, len(rec.Data))
			}
			var d audit.Activity
			dec := json.NewDecoder(strings.NewReader(string(rec.Data)))
			dec.DisallowUnknownFields()
			if err := dec.Decode(&d); err != nil {
				t.Fatalf("data %s: %v", rec.Data, err)
			}
			for _, e := range d.Events {
				if !validEvent(e) {
					t.Fatalf("invalid event recorded: %+v", e)
				}
			}
			recorded += len(d.Events)
			dropped = addSat(dropped, d.Dropped)
		}
		if recorded != len(c.events) || (c.dropped < 1<<62 && dropped != c.dropped) {
			t.Fatalf("recorded %d events and %d dropped; want %d and %d", recorded, dropped, len(c.events), c.dropped)
		}
	})
}

func validEvent(e audit.ActivityEvent) bool {
	known := false
	for _, op := range ops {
		known = known || op == e.Op
	}
	return known && e.PID > 0 && e.Ns >= 0 && protocol.ValidExecID(e.ExecID) && len(e.Path) <= MaxPathBytes &&
		utf8.ValidString(e.Path) && strings.HasPrefix(e.Path, "/") && path.Clean(e.Path) == e.Path && !strings.ContainsRune(e.Path, 0)
}
