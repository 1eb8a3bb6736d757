package policy

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
)

func TestCleanPath(t *testing.T) {
	long := "/" + strings.Repeat("a", MaxPathBytes-1)
	for in, want := range map[string]string{
		"/":                        "/",
		"/..":                      "/",
		"/../..":                   "/",
		"/../../etc":               "/etc",
		"//":                       "/",
		"///a///b//":               "/a/b",
		"/a/":                      "/a",
		"/a/.":                     "/a",
		"/a/./b":                   "/a/b",
		"/a/b/..":                  "/a",
		"/a/b/../../..":            "/",
		"/workspace/../etc/shadow": "/etc/shadow",
		"/workspace/.ssh/":         "/workspace/.ssh",
		"/workspace/...":           "/workspace/...",
		"/workspace/..a":           "/workspace/..a",
		"/wörk space/ü":            "/wörk space/ü",
		long:                       long,
	} {
		got, err := CleanPath(in)
		if err != nil || got != want {
			t.Errorf("CleanPath(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for name, in := range map[string]string{
		"empty":                    "",
		"relative":                 "a/b",
		"dot relative":             "./a",
		"dotdot":                   "../etc",
		"NUL":                      "/workspace/a\x00b",
		"invalid UTF-8":            "/workspace/\xff",
		"surrogate":                "/workspace/\xed\xa0\x80",
		"too long":                 long + "a",
		"too long, clean to short": "/" + strings.Repeat("./", MaxPathBytes),
	} {
		if got, err := CleanPath(in); !errors.Is(err, ErrInvalidInput) {
			t.Errorf("%s: CleanPath(%.40q) = %q, %v; want ErrInvalidInput", name, in, got, err)
		}
	}
}

func TestDecodeInput(t *testing.T) {
	cases := []struct {
		kind Kind
		src  string
		want Input
	}{
		{KindAPI, `{"version":1,"caller":{"type":"peer","uid":1000,"gid":100,"pid":7},"daemon_uid":0,"procedure":"/carrel.api.v1.VMService/Exec","vm":"demo"}`,
			&APIInput{Caller: Caller{Type: CallerPeer, UID: 1000, GID: 100, PID: 7}, Procedure: "/carrel.api.v1.VMService/Exec", VM: "demo"}},
		{KindAPI, `{"caller":{"type":"token","token_id":"tok-1","vm":"a"},"procedure":"/carrel.api.v1.VMService/ListVMs","vm":""}`,
			&APIInput{Caller: Caller{Type: CallerToken, TokenID: "tok-1", VM: "a"}, Procedure: "/carrel.api.v1.VMService/ListVMs"}},
		{KindExec, `{"version":1,"caller":{"type":"peer","uid":0},"vm":"demo","argv":["sh","-c","ls"],"env":{"K":"V"},"cwd":"/workspace/./src/","tty":true}`,
			&ExecInput{Caller: Caller{Type: CallerPeer}, VM: "demo", Argv: []string{"sh", "-c", "ls"}, Env: map[string]string{"K": "V"}, Cwd: "/workspace/src", User: DefaultUser, TTY: true}},
		{KindExec, `{"caller":{"type":"peer"},"argv":["true"]}`,
			&ExecInput{Caller: Caller{Type: CallerPeer}, Argv: []string{"true"}, Cwd: DefaultCwd, User: DefaultUser}},
		{KindFS, `{"version":1,"caller":{"type":"peer","uid":1000},"vm":"demo","operation":"write","path":"/workspace//a.txt","recursive":false}`,
			&FSInput{Caller: Caller{Type: CallerPeer, UID: 1000}, VM: "demo", Operation: OpWrite, Path: "/workspace/a.txt"}},
		{KindNet, `{"version":1,"vm":"demo","direction":"egress","host":"Registry.NPMJS.org.","port":443}`,
			&NetInput{VM: "demo", Direction: DirEgress, Host: "registry.npmjs.org", Port: 443, Protocol: "tcp"}},
		{KindNet, `{"caller":{"type":"token","token_id":"t","vm":"demo"},"vm":"demo","direction":"forward","host":"localhost","port":8080,"protocol":"udp"}`,
			&NetInput{Caller: Caller{Type: CallerToken, TokenID: "t", VM: "demo"}, VM: "demo", Direction: DirForward, Host: "localhost", Port: 8080, Protocol: "udp"}},
		{KindGuest, `{"version":1,"vm":"demo","request":"checkpoint","args":{"name":"before"}}`,
			&GuestInput{VM: "demo", Request: "checkpoint", Args: map[string]string{"name": "before"}}},
	}
	for _, c := range cases {
		got, err := DecodeInput(c.kind, []byte(c.src))
		if err != nil {
			t.Errorf("DecodeInput(%s, %s): %v", c.kind, c.src, err)
			continue
		}
		if got.Kind() != c.kind || !reflect.DeepEqual(got, c.want) {
			t.Errorf("DecodeInput(%s, %s) = %+v, want %+v", c.kind, c.src, got, c.want)
		}
	}
}

func TestDecodeInputRefuses(t *testing.T) {
	deep := `{"version":1,"vm":"x","request":"r","args":` + strings.Repeat(`[`, 8) + strings.Repeat(`]`, 8) + `}`
	cases := []struct {
		name string
		kind Kind
		src  string
	}{
		{"unknown field", KindFS, `{"caller":{"type":"peer"},"operation":"read","path":"/a","mode":"0644"}`},
		{"unknown caller field", KindFS, `{"caller":{"type":"peer","root":true},"operation":"read","path":"/a"}`},
		{"version 2", KindGuest, `{"version":2,"vm":"x","request":"r"}`},
		{"version 0", KindGuest, `{"version":0,"vm":"x","request":"r"}`},
		{"version a string", KindGuest, `{"version":"1","vm":"x","request":"r"}`},
		{"version twice", KindGuest, `{"version":1,"version":2,"vm":"x","request":"r"}`},
		{"nested too deep", KindGuest, deep},
		{"too big", KindGuest, `{"vm":"x","request":"r","args":{"a":"` + strings.Repeat("x", MaxInputBytes) + `"}}`},
		{"not an object", KindGuest, `["vm"]`},
		{"null", KindGuest, `null`},
		{"empty", KindGuest, ``},
		{"trailing data", KindGuest, `{"vm":"x","request":"r"} {}`},
		{"truncated", KindGuest, `{"vm":"x","request":"r"`},
		{"wrong type", KindNet, `{"direction":"egress","host":"a","port":"443"}`},
		{"unknown kind", Kind("disk"), `{}`},
		{"no caller", KindExec, `{"argv":["ls"]}`},
		{"empty argv", KindExec, `{"caller":{"type":"peer"},"argv":[]}`},
		{"env name with =", KindExec, `{"caller":{"type":"peer"},"argv":["ls"],"env":{"A=B":"c"}}`},
		{"relative cwd", KindExec, `{"caller":{"type":"peer"},"argv":["ls"],"cwd":"src"}`},
		{"NUL in argv", KindExec, `{"caller":{"type":"peer"},"argv":["ls\u0000x"]}`},
		{"bad operation", KindFS, `{"caller":{"type":"peer"},"operation":"rename","path":"/a"}`},
		{"relative path", KindFS, `{"caller":{"type":"peer"},"operation":"read","path":"a"}`},
		{"port 0", KindNet, `{"direction":"egress","host":"a","port":0}`},
		{"port too big", KindNet, `{"direction":"egress","host":"a","port":65536}`},
		{"bad host", KindNet, `{"direction":"egress","host":"a b","port":1}`},
		{"empty host", KindNet, `{"direction":"egress","host":".","port":1}`},
		{"empty label", KindNet, `{"direction":"egress","host":"example..com","port":1}`},
		{"two root dots", KindNet, `{"direction":"egress","host":"example.com..","port":1}`},
		{"leading dot", KindNet, `{"direction":"egress","host":".example.com","port":1}`},
		// strings.ToLower maps these to ASCII: the policy would see a host
		// ("key.com", "github.com") that is not the one asked for.
		{"kelvin sign", KindNet, `{"direction":"egress","host":"\u212aey.com","port":1}`},
		{"dotted capital I", KindNet, `{"direction":"egress","host":"g\u0130thub.com","port":1}`},
		{"bad protocol", KindNet, `{"direction":"egress","host":"a","port":1,"protocol":"sctp"}`},
		{"empty request", KindGuest, `{"vm":"x","request":""}`},
		{"procedure not a path", KindAPI, `{"caller":{"type":"peer"},"procedure":"CreateVM"}`},
		{"bad caller type", KindAPI, `{"caller":{"type":"root"},"procedure":"/a"}`},
	}
	for _, c := range cases {
		in, err := DecodeInput(c.kind, []byte(c.src))
		if !errors.Is(err, ErrInvalidInput) || in != nil {
			t.Errorf("%s: DecodeInput = %+v, %v; want nil and ErrInvalidInput", c.name, in, err)
		}
	}
	// Exactly at the depth limit is fine.
	ok := `{"version":1,"vm":"x","request":"r","args":{}}`
	if _, err := DecodeInput(KindGuest, []byte(ok)); err != nil {
		t.Errorf("DecodeInput(%s): %v", ok, err)
	}
}

func TestNormalizeLimits(t *testing.T) {
	big := strings.Repeat("x", MaxStringBytes+1)
	for name, in := range map[string]Input{
		"too many args":   &ExecInput{Caller: peer(0), Argv: make([]string, MaxArgs+1)},
		"too many env":    &ExecInput{Caller: peer(0), Argv: []string{"ls"}, Env: manyEnv(MaxEnv + 1)},
		"big argument":    &ExecInput{Caller: peer(0), Argv: []string{"echo", big}},
		"big env value":   &ExecInput{Caller: peer(0), Argv: []string{"ls"}, Env: map[string]string{"A": big}},
		"big vm":          &FSInput{Caller: peer(0), VM: big, Operation: OpRead, Path: "/a"},
		"big token id":    &APIInput{Caller: Caller{Type: CallerToken, TokenID: big}, Procedure: "/a"},
		"long host":       &NetInput{Direction: DirEgress, Host: strings.Repeat("a", 254), Port: 1},
		"many guest args": &GuestInput{Request: "r", Args: manyEnv(65)},
		"bad guest arg":   &GuestInput{Request: "r", Args: map[string]string{"a": "\xff"}},
	} {
		if err := in.Normalize(); !errors.Is(err, ErrInvalidInput) {
			t.Errorf("%s: Normalize = %v, want ErrInvalidInput", name, err)
		}
	}
	// Sizes below the limits are fine.
	in := &ExecInput{Caller: peer(0), Argv: make([]string, MaxArgs), Env: manyEnv(MaxEnv)}
	in.Argv[0] = "ls"
	if err := in.Normalize(); err != nil {
		t.Errorf("an exec input at the limits: %v", err)
	}
}

func manyEnv(n int) map[string]string {
	m := make(map[string]string, n)
	for i := range n {
		m[fmt.Sprintf("V%d", i)] = "v"
	}
	return m
}

// Normalize is idempotent: a normalised input normalises to itself, so
// carreld, the policy and the audit record all see one form.
func TestNormalizeIdempotent(t *testing.T) {
	for _, src := range []struct {
		kind Kind
		doc  string
	}{
		{KindNet, `{"direction":"egress","host":"Example.COM.","port":443}`},
		{KindNet, `{"direction":"egress","host":"example.com..","port":443}`},
		{KindFS, `{"caller":{"type":"peer"},"operation":"read","path":"/a/../b/./c//"}`},
		{KindExec, `{"caller":{"type":"peer"},"argv":["ls"],"cwd":"/workspace/../tmp/"}`},
	} {
		in, err := DecodeInput(src.kind, []byte(src.doc))
		if err != nil {
			continue // refusing is fine too
		}
		before := Digest(in)
		if err := in.Normalize(); err != nil {
			t.Errorf("%s: a normalised input does not normalise again: %v", src.doc, err)
			continue
		}
		if after := Digest(in); after != before {
			t.Errorf("%s: normalising twice changed the input to %+v", src.doc, in)
		}
	}
}
