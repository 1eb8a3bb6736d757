package policystore

import (
	"encoding/json"
	"strconv"
	"testing"

	"github.com/carrel-os/carrel/policy"
)

func TestRingKeepsNewestWithoutInput(t *testing.T) {
	r := newRing(3)
	all := func(*policy.Decision) bool { return true }
	if got := r.filter(all, 10); len(got) != 0 {
		t.Fatalf("empty ring: %d decisions", len(got))
	}
	for i := range 5 {
		r.add(policy.Decision{ID: strconv.Itoa(i), Input: json.RawMessage(`{"path":"/workspace/x"}`)})
		if want := min(i+1, 3); len(r.buf) != want {
			t.Fatalf("after %d adds the ring holds %d, want %d", i+1, len(r.buf), want)
		}
	}
	var ids string
	for _, d := range r.filter(all, 10) {
		ids += d.ID
		if d.Input != nil {
			t.Errorf("decision %s kept its input", d.ID)
		}
	}
	if ids != "234" {
		t.Errorf("ring holds %q, want the newest three oldest first, 234", ids)
	}
	if got := r.filter(all, 2); len(got) != 2 || got[0].ID != "3" || got[1].ID != "4" {
		t.Errorf("limit 2: %+v", got)
	}
}
