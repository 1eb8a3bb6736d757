package guestreq

import (
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

func TestLimiter(t *testing.T) {
	now := time.Unix(1000, 0)
	l := &limiter{burst: 3, every: time.Minute, tokens: 3, last: now}
	for i := 0; i < 3; i++ {
		if !l.allow(now) {
			t.Fatalf("request %d of the burst refused", i+1)
		}
	}
	if l.allow(now.Add(time.Second)) {
		t.Fatal("a fourth request at once was allowed")
	}
	if !l.allow(now.Add(61 * time.Second)) {
		t.Fatal("a request a minute later was refused")
	}
	if l.allow(now.Add(62 * time.Second)) {
		t.Fatal("two requests a minute later were allowed")
	}
	// A long quiet refills the burst, no more.
	later := now.Add(time.Hour)
	for i := 0; i < 3; i++ {
		if !l.allow(later) {
			t.Fatalf("request %d after an hour refused", i+1)
		}
	}
	if l.allow(later) {
		t.Fatal("the burst grew past its size")
	}
}

func TestCheck(t *testing.T) {
	for _, c := range []struct {
		req  *agentv1.GuestRequest
		want string
	}{
		{&agentv1.GuestRequest{Kind: "checkpoint", Name: "green-tests", Note: "all pass"}, ""},
		{&agentv1.GuestRequest{Kind: "shutdown-host", Name: "x"}, "unknown request"},
		{&agentv1.GuestRequest{Kind: "checkpoint", Name: "../../etc"}, "lower-case"},
		{&agentv1.GuestRequest{Kind: "checkpoint", Name: ""}, "lower-case"},
		{&agentv1.GuestRequest{Kind: "checkpoint", Name: "ok", Note: strings.Repeat("x", maxNote+1)}, "over"},
	} {
		if got := check(c.req); (c.want == "") != (got == "") || !strings.Contains(got, c.want) {
			t.Errorf("check(%v) = %q, want %q", c.req, got, c.want)
		}
	}
}

// FuzzCheck: whatever the guest sends, check answers, an accepted name is
// a valid snapshot name, and the reason is bounded text.
func FuzzCheck(f *testing.F) {
	f.Add("checkpoint", "green", "note")
	f.Add("checkpoint", "a/../b", "")
	f.Add("\x00\xff", "", "\n")
	f.Fuzz(func(t *testing.T, kind, name, note string) {
		got := check(&agentv1.GuestRequest{Kind: kind, Name: name, Note: note})
		if got == "" && (kind != "checkpoint" || strings.ContainsAny(name, "/.\x00 ") || len(note) > maxNote || name == "") {
			t.Fatalf("accepted %q %q (%d-byte note)", kind, name, len(note))
		}
		if len(got) > 256 || !utf8.ValidString(got) {
			t.Fatalf("reason %q", got)
		}
	})
}
