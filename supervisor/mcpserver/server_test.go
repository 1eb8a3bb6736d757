package mcpserver

import (
	"strings"
	"testing"
	"unicode/utf8"
)

func TestCapped(t *testing.T) {
	c := &capped{max: 5}
	c.Write([]byte("abc"))
	if c.String() != "abc" || c.cut {
		t.Errorf("under the cap: %q %v", c.String(), c.cut)
	}
	if n, err := c.Write([]byte("defgh")); n != 5 || err != nil {
		t.Errorf("a write past the cap reports %d, %v: the command must not see an error", n, err)
	}
	if c.String() != "abcde" || !c.cut {
		t.Errorf("past the cap: %q %v", c.String(), c.cut)
	}
	// A cut through a UTF-8 sequence drops its start.
	c = &capped{max: 4}
	c.Write([]byte("abc€"))
	if got := c.String(); got != "abc" || !utf8.ValidString(got) {
		t.Errorf("cut in a rune: %q", got)
	}
}

func TestTarget(t *testing.T) {
	scoped := &tools{vm: "dev"}
	if vm, err := scoped.target(VMArg{}); vm != "dev" || err != nil {
		t.Errorf("scoped, none named: %q %v", vm, err)
	}
	if vm, err := scoped.target(VMArg{VM: "dev"}); vm != "dev" || err != nil {
		t.Errorf("scoped, its own named: %q %v", vm, err)
	}
	if _, err := scoped.target(VMArg{VM: "other"}); err == nil || !strings.Contains(err.Error(), `"dev" only`) {
		t.Errorf("scoped, another named: %v", err)
	}
	open := &tools{}
	if _, err := open.target(VMArg{}); err == nil {
		t.Error("unscoped, none named: no error")
	}
	if vm, err := open.target(VMArg{VM: "x"}); vm != "x" || err != nil {
		t.Errorf("unscoped: %q %v", vm, err)
	}
}
