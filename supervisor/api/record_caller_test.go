package api

import (
	"encoding/json"
	"testing"

	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/supervisor/audit"
)

// TestRecordedCallerIsPolicys: a caller is recorded as an audit.Caller,
// which must write what policy.Caller writes (the caller in a decision's
// input document), whatever its type.
func TestRecordedCallerIsPolicys(t *testing.T) {
	for _, c := range []policy.Caller{
		{Type: policy.CallerPeer},
		{Type: policy.CallerPeer, UID: 1000, GID: 100, PID: 42, Groups: []string{"users", "wheel"}},
		{Type: policy.CallerToken, TokenID: "tok_1", VM: "demo"},
		{Type: policy.CallerToken},
		{Type: "other", UID: 1, TokenID: "t"},
		{},
	} {
		want, err := json.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		got, err := json.Marshal(audit.Caller(c))
		if err != nil || string(got) != string(want) {
			t.Errorf("%+v: recorded as %s, %v; policy writes %s", c, got, err, want)
		}
	}
}
