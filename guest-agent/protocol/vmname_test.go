package protocol

import (
	"strings"
	"testing"
)

func TestValidVMName(t *testing.T) {
	for _, ok := range []string{"a", "demo", "vm-1", strings.Repeat("a", 63)} {
		if err := ValidVMName(ok); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
	for _, bad := range []string{"", "1vm", "Demo", "a_b", "a/b", "..", "a.b", strings.Repeat("a", 64), "-x", "vm\n"} {
		if err := ValidVMName(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
