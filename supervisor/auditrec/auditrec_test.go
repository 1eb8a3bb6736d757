package auditrec

import (
	"encoding/json"
	"reflect"
	"testing"
	"time"

	"github.com/carrel-os/carrel/policy"
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
