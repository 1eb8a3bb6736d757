package policy

import (
	"strconv"
	"testing"
)

func TestDecisionCacheForgetsOldestWhenFull(t *testing.T) {
	c := newDecisionCache(3)
	for i := range 5 {
		c.put(strconv.Itoa(i), outcome{allow: true, rule: strconv.Itoa(i)})
	}
	c.put("4", outcome{rule: "again"}) // already there: kept as it was
	for i, want := range []bool{false, false, true, true, true} {
		o, ok := c.get(strconv.Itoa(i))
		if ok != want {
			t.Errorf("get(%d): cached %v, want %v", i, ok, want)
		}
		if ok && o.rule != strconv.Itoa(i) {
			t.Errorf("get(%d): rule %q", i, o.rule)
		}
	}
	if len(c.m) != 3 || len(c.order) != 3 {
		t.Errorf("%d entries, %d keys in order; want 3 and 3", len(c.m), len(c.order))
	}
}
