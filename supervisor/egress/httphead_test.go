package egress

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/supervisor/audit"
)

func TestParseRequestHead(t *testing.T) {
	for _, c := range []struct {
		in    string
		err   error // nil: parsed
		hosts []string
	}{
		{"GET / HTTP/1.1\r\nHost: a.test\r\n\r\nbody", nil, []string{"a.test"}},
		{"POST http://a.test/x HTTP/1.0\r\nhost:a.test:8080 \r\nX: y\r\n\r\n", nil, []string{"a.test:8080"}},
		{"GET / HTTP/1.1\r\n\r\n", nil, nil},
		{"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", nil, []string{"a", "b"}},
		{"", ErrHeadNeedMore, nil},
		{"GE", ErrHeadNeedMore, nil},
		{"GET / HTTP/1.1\r\nHost: a", ErrHeadNeedMore, nil},
		{"\x16\x03\x01", ErrNotHTTP, nil},
		{"get / HTTP/1.1\r\n", ErrNotHTTP, nil},
		{"SSH-2.0-OpenSSH\r\n", ErrNotHTTP, nil},
		{"PING\r\n", ErrNotHTTP, nil},
		{"SET key value\r\n", ErrNotHTTP, nil},
		{"ABCDEFGHIJKLMNOPQ / HTTP/1.1\r\n", ErrNotHTTP, nil},
		{" GET / HTTP/1.1\r\n", ErrNotHTTP, nil},
		{"GET / HTTP/2.0\r\n\r\n", ErrNotHTTP, nil},
	} {
		h, err := ParseRequestHead([]byte(c.in))
		if c.err != nil {
			if !errors.Is(err, c.err) {
				t.Errorf("%q: %v, want %v", c.in, err, c.err)
			}
			continue
		}
		if err != nil || strings.Join(h.Hosts, ",") != strings.Join(c.hosts, ",") || h.Len != strings.Index(c.in, "\r\n\r\n")+4 {
			t.Errorf("%q: %+v, %v", c.in, h, err)
		}
	}
	for _, bad := range []string{
		"GET  / HTTP/1.1\r\n\r\n",
		"GET / HTTP/1.1\r\nno colon\r\n\r\n",
		"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n",
		"GET / HTTP/1.1\r\nX: " + strings.Repeat("a", MaxRequestHeadBytes) + "\r\n\r\n",
	} {
		if _, err := ParseRequestHead([]byte(bad)); err == nil || errors.Is(err, ErrNotHTTP) || errors.Is(err, ErrHeadNeedMore) {
			t.Errorf("%.60q: %v, want malformed", bad, err)
		}
	}
	if _, err := ParseRequestHead([]byte("GET /" + strings.Repeat("a", MaxRequestHeadBytes))); err == nil || errors.Is(err, ErrHeadNeedMore) {
		t.Errorf("an endless request line: %v", err)
	}
}

func TestCheckHead(t *testing.T) {
	for _, c := range []struct {
		head, why string // why: a word of the refusal, "" for allowed
	}{
		{"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n", ""},
		{"GET / HTTP/1.1\r\nHost: ALLOWED.test.:80\r\n\r\n", ""},
		{"GET http://allowed.test/x HTTP/1.1\r\nHost: allowed.test\r\n\r\n", ""},
		{"OPTIONS * HTTP/1.1\r\nHost: allowed.test\r\n\r\n", ""},
		{"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n", "does not match"},
		{"GET / HTTP/1.1\r\nHost: allowed.test:8080\r\n\r\n", "another port"},
		{"GET / HTTP/1.1\r\n\r\n", "0 Host headers"},
		{"GET / HTTP/1.1\r\nHost: allowed.test\r\nHost: other.test\r\n\r\n", "2 Host headers"},
		{"GET http://other.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n", "request target"},
		{"GET allowed.test HTTP/1.1\r\nHost: allowed.test\r\n\r\n", "neither a path"},
	} {
		h, err := ParseRequestHead([]byte(c.head))
		if err != nil {
			t.Fatalf("%q: %v", c.head, err)
		}
		why := checkHead(h, "allowed.test", 80)
		if (c.why == "") != (why == "") || !strings.Contains(why, c.why) {
			t.Errorf("%q: %q, want %q", c.head, why, c.why)
		}
	}
	h, _ := ParseRequestHead([]byte("GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n"))
	if why := checkHead(h, "::1", 80); why != "" {
		t.Errorf("an IPv6 literal: %s", why)
	}
	h, _ = ParseRequestHead([]byte("GET / HTTP/1.1\r\nHost: a.test\r\nConnection: keep-alive, X-Secret\r\nKeep-Alive: 5\r\nX: y\r\n\r\n"))
	if got, want := string(closeHead(h)), "GET / HTTP/1.1\r\nHost: a.test\r\nX: y\r\nConnection: close\r\n\r\n"; got != want {
		t.Errorf("closeHead: %q, want %q", got, want)
	}
}

// TestHostHeaderChecked: the host checks a plain HTTP request's Host
// against the host the connection was decided for, whatever the guest
// calls the connection, before any of it goes upstream; an allowed one
// goes with "Connection: close".
func TestHostHeaderChecked(t *testing.T) {
	w := newWorld(t)
	run := func(kind agentv1.EgressKind, msgs ...any) (string, *conn, error) {
		c := &conn{p: w.proxy, v: &vmState{up: newBucket(), down: newBucket()}, rec: audit.Egress{Host: "allowed.test", Port: 80, IP: "127.0.0.1"},
			req: &agentv1.EgressDialRequest{Id: 1, Host: "allowed.test", Port: 80, Kind: kind}}
		up, far := net.Pipe()
		got := make(chan string, 1)
		go func() { b, _ := io.ReadAll(far); got <- string(b) }()
		s := &scriptStream{msgs: msgs}
		err := c.copyUp(context.Background(), s, up, &toGuest{s: s})
		up.Close()
		return <-got, c, err
	}
	for _, kind := range []agentv1.EgressKind{agentv1.EgressKind_EGRESS_KIND_HTTP, agentv1.EgressKind_EGRESS_KIND_HTTP_CONNECT, agentv1.EgressKind_EGRESS_KIND_SOCKS5} {
		sent, c, err := run(kind, []byte("GET /a HTTP/1.1\r\nHo"), []byte("st: other.test\r\n\r\n"), "close")
		var r *refusal
		if !errors.As(err, &r) || !strings.Contains(r.msg, `"other.test" does not match`) || sent != "" || c.rec.HTTPHost != "other.test" {
			t.Errorf("%s: a Host of another name: %v; upstream got %q; recorded %q", kind, err, sent, c.rec.HTTPHost)
		}
		sent, _, err = run(kind, []byte("GET /a HTTP/1.1\r\nHost: allowed.test\r\nConnection: keep-alive\r\n\r\nGET /b HTTP/1.1\r\n"), "close")
		if err != nil || sent != "GET /a HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\nGET /b HTTP/1.1\r\n" {
			t.Errorf("%s: an allowed request: %v; upstream got %q", kind, err, sent)
		}
	}
	// Another protocol passes through a tunnel, not through plain http.
	if sent, _, err := run(agentv1.EgressKind_EGRESS_KIND_HTTP_CONNECT, []byte("SSH-2.0-x\r\n"), "close"); err != nil || sent != "SSH-2.0-x\r\n" {
		t.Errorf("ssh in a CONNECT tunnel: %v, %q", err, sent)
	}
	var r *refusal
	if sent, _, err := run(agentv1.EgressKind_EGRESS_KIND_HTTP, []byte("SSH-2.0-x\r\n"), "close"); !errors.As(err, &r) || sent != "" {
		t.Errorf("ssh as plain http: %v, %q", err, sent)
	}
	if sent, _, err := run(agentv1.EgressKind_EGRESS_KIND_HTTP, []byte("GET / HTTP/1.1\r\nHost: allowed.test\r\n"), "close"); !errors.As(err, &r) || sent != "" {
		t.Errorf("a head cut short by a close: %v, %q", err, sent)
	}
}

// FuzzParseRequestHead: whatever a guest sends first, the parser neither
// panics nor reads past its caps, and a head it accepts is one.
func FuzzParseRequestHead(f *testing.F) {
	for _, s := range []string{"GET / HTTP/1.1\r\nHost: a\r\n\r\n", "PUT http://a/ HTTP/1.0\r\n\r\nbody", "GET", "\x16\x03", "GET / HTTP/1.1\r\nX\r\n\r\n"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := ParseRequestHead(b)
		if err != nil {
			return
		}
		if h.Len > len(b) || h.Len > MaxRequestHeadBytes || string(b[h.Len-4:h.Len]) != "\r\n\r\n" {
			t.Fatalf("a head of %d bytes in %d", h.Len, len(b))
		}
		out := closeHead(h)
		if _, err := ParseRequestHead(out); err != nil {
			t.Fatalf("the rewritten head does not parse: %v (%q)", err, out)
		}
		_ = checkHead(h, "a", 80)
	})
}
