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

// TestParseMatches: what the guest's find and grep print is read as
// matches, and what does not read as one is left out.
func TestParseMatches(t *testing.T) {
	got := parseMatches("/w/a.txt:3:hello: world\nBinary file /w/b matches\n/w/c:x:y\n:1:no path\n/w/d:0:zero\n/w/e:2:\n", true, false)
	want := []Match{{Path: "/w/a.txt", Line: 3, Text: "hello: world"}, {Path: "/w/e", Line: 2}}
	if len(got.Matches) != len(want) || got.Matches[0] != want[0] || got.Matches[1] != want[1] || got.Truncated {
		t.Errorf("content matches: %+v", got)
	}
	got = parseMatches("/w/a\x00/w/new\nline\x00\x00", false, true)
	if len(got.Matches) != 2 || got.Matches[1].Path != "/w/new\nline" || !got.Truncated {
		t.Errorf("name matches: %+v", got)
	}
	many := strings.Repeat("/w/f:1:x\n", maxMatches+5)
	if got := parseMatches(many, true, false); len(got.Matches) != maxMatches || !got.Truncated {
		t.Errorf("past the cap: %d matches, truncated %v", len(got.Matches), got.Truncated)
	}
}

// FuzzParseMatches: whatever the guest prints, the reader answers within
// its cap, and every match has a path and, for content, a line.
func FuzzParseMatches(f *testing.F) {
	f.Add("/w/a:1:x\n", true)
	f.Add("/w/a\x00/w/b\x00", false)
	f.Add("::::\n\x00\n:0:", true)
	f.Fuzz(func(t *testing.T, out string, content bool) {
		got := parseMatches(out, content, false)
		if len(got.Matches) > maxMatches {
			t.Fatalf("%d matches", len(got.Matches))
		}
		for _, m := range got.Matches {
			if m.Path == "" || (content && m.Line <= 0) {
				t.Fatalf("match %+v", m)
			}
		}
	})
}
