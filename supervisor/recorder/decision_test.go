package recorder

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"reflect"
	"testing"
	"time"

	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/cas"
)

// TestDecisionRecordKeepsEveryField: a decision is recorded as an
// audit.Decision, which must write each field policy.Decision writes
// (it was recorded as one, with its input beside it). A field added to
// policy.Decision fails this until audit.Decision has it too.
func TestDecisionRecordKeepsEveryField(t *testing.T) {
	var d policy.Decision
	v := reflect.ValueOf(&d).Elem()
	for i := range v.NumField() {
		switch f := v.Field(i); f.Interface().(type) {
		case time.Time:
			f.Set(reflect.ValueOf(time.Date(2026, 11, 26, 1, 2, 3, 4, time.UTC)))
		case json.RawMessage:
			f.Set(reflect.ValueOf(json.RawMessage(`{"k":1}`)))
		default:
			switch f.Kind() {
			case reflect.String:
				f.SetString("x-" + v.Type().Field(i).Name)
			case reflect.Bool:
				f.SetBool(true)
			default:
				t.Fatalf("policy.Decision.%s: a %s; teach this test to set it", v.Type().Field(i).Name, f.Type())
			}
		}
	}
	want, err := json.Marshal(struct {
		policy.Decision
		Input json.RawMessage `json:"input,omitempty"`
	}{d, d.Input})
	if err != nil {
		t.Fatal(err)
	}
	rec := decisionRecord(d)
	rec.Input = d.Input
	got, err := json.Marshal(rec)
	if err != nil || string(got) != string(want) {
		t.Errorf("recorded as\n%s, %v; want\n%s", got, err, want)
	}
}

// memLog keeps appended records; it takes no intents or blobs.
type memLog struct {
	recs    []audit.Record
	commits int
}

func (m *memLog) AppendAll(_ context.Context, recs ...audit.Record) ([]uint64, error) {
	var seqs []uint64
	for _, r := range recs {
		seqs = append(seqs, uint64(len(m.recs)))
		m.recs = append(m.recs, r)
	}
	m.commits++
	return seqs, nil
}

func (m *memLog) BeginAfter(context.Context, []audit.Record, audit.Record) (*audit.Pending, error) {
	return nil, errors.New("memLog takes no intents")
}

func (m *memLog) PutBlob(io.Reader) (string, error) { return "", errors.New("memLog keeps no blobs") }

func (m *memLog) CreateBlob() (*cas.Writer, error) { return nil, errors.New("memLog keeps no blobs") }

// TestDecisionSession: a decision is recorded in the session its context
// gives its VM, and in none when the context speaks of another VM.
func TestDecisionSession(t *testing.T) {
	var log memLog
	r := New(&log, nil)
	ctx := WithSession(context.Background(), "a", "ses_1")
	for _, vm := range []string{"a", "b"} {
		if err := r.Decision(ctx, policy.Decision{ID: "dec-" + vm, VM: vm, Allow: true}, nil); err != nil {
			t.Fatal(err)
		}
	}
	if len(log.recs) != 2 || log.recs[0].Session != "ses_1" || log.recs[1].Session != "" || log.recs[0].Kind != audit.KindPolicyDecision {
		t.Errorf("records %+v", log.recs)
	}
	// A nil recorder records nothing, and its calls are nil and safe.
	var none *Recorder
	c := none.Call("a", "ses_1", audit.Caller{Type: audit.CallerPeer})
	if c != nil {
		t.Fatal("a nil recorder started a call")
	}
	if e, err := c.BeginExec(ctx, nil, false); e != nil || err != nil {
		t.Errorf("BeginExec on nil: %v %v", e, err)
	}
	c.Read(ctx, audit.FileOp{Op: "stat"}, nil)
	if len(log.recs) != 2 {
		t.Errorf("records after nil calls: %d", len(log.recs))
	}
}

// TestHeldDecisions: under Hold, decisions wait for the call's next
// durable record and share its commit; Flush writes them at once.
func TestHeldDecisions(t *testing.T) {
	var log memLog
	r := New(&log, nil)
	ctx := Hold(context.Background())
	for _, id := range []string{"dec-1", "dec-2"} {
		if err := r.Decision(ctx, policy.Decision{ID: id, VM: "a", Allow: true}, nil); err != nil {
			t.Fatal(err)
		}
	}
	if len(log.recs) != 0 {
		t.Fatalf("held decisions written at once: %d", len(log.recs))
	}
	call := NewAPICall("/x")
	r.APICallEnded(ctx, call, "ok", nil)
	if len(log.recs) != 3 || log.commits != 1 || log.recs[2].Kind != audit.KindAPICall {
		t.Errorf("api.call with the held decisions: %d records in %d commits", len(log.recs), log.commits)
	}
	if err := r.Decision(ctx, policy.Decision{ID: "dec-3", VM: "a", Allow: true}, nil); err != nil {
		t.Fatal(err)
	}
	if err := r.Flush(ctx); err != nil || len(log.recs) != 4 || log.commits != 2 {
		t.Errorf("flush: %v, %d records in %d commits", err, len(log.recs), log.commits)
	}
	if err := r.Flush(ctx); err != nil || log.commits != 2 {
		t.Errorf("a flush with nothing held wrote: %v, %d commits", err, log.commits)
	}
}
