package egress

import (
	"bytes"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"testing"
	"time"
)

// captureConn keeps what a TLS client writes and answers its reads with
// EOF, so that a handshake gives up after its ClientHello.
type captureConn struct {
	net.Conn
	buf bytes.Buffer
}

func (c *captureConn) Write(p []byte) (int, error)      { return c.buf.Write(p) }
func (c *captureConn) Read([]byte) (int, error)         { return 0, io.EOF }
func (c *captureConn) Close() error                     { return nil }
func (c *captureConn) SetDeadline(time.Time) error      { return nil }
func (c *captureConn) SetReadDeadline(time.Time) error  { return nil }
func (c *captureConn) SetWriteDeadline(time.Time) error { return nil }
func (c *captureConn) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (c *captureConn) RemoteAddr() net.Addr             { return &net.TCPAddr{} }

// realHello is the ClientHello crypto/tls sends with cfg.
func realHello(t testing.TB, cfg *tls.Config) []byte {
	t.Helper()
	c := &captureConn{}
	tls.Client(c, cfg).Handshake()
	if c.buf.Len() == 0 {
		t.Fatal("the TLS client wrote nothing")
	}
	return c.buf.Bytes()
}

func TestParseRealClientHellos(t *testing.T) {
	for _, cfg := range []*tls.Config{
		{ServerName: "allowed.test"},
		{ServerName: "Registry.NPMJS.org"},
		{ServerName: "a.b.c.example", MaxVersion: tls.VersionTLS12},
		{ServerName: "x.test", MinVersion: tls.VersionTLS13, NextProtos: []string{"h2", "http/1.1"}},
		{ServerName: "pq.test", CurvePreferences: []tls.CurveID{tls.X25519MLKEM768, tls.X25519}},
	} {
		b := realHello(t, cfg)
		h, err := ParseClientHello(b)
		if err != nil || h.ServerName != cfg.ServerName || h.Len != len(b) || h.ECH {
			t.Errorf("%s: %+v, %v (%d bytes)", cfg.ServerName, h, err, len(b))
		}
		// Every proper prefix is incomplete, never an error or a hello.
		for n := 0; n < len(b); n++ {
			if _, err := ParseClientHello(b[:n]); !errors.Is(err, ErrNeedMore) {
				t.Fatalf("%s: %d of %d bytes: %v, want ErrNeedMore", cfg.ServerName, n, len(b), err)
			}
		}
		// Split over two records, as a client may send it.
		body := b[5:]
		cut := len(body) / 3
		split := append(tlsRecord(22, body[:cut]), tlsRecord(22, body[cut:])...)
		if h, err := ParseClientHello(split); err != nil || h.ServerName != cfg.ServerName || h.Len != len(split) {
			t.Errorf("%s in two records: %+v, %v", cfg.ServerName, h, err)
		}
		// Data after the hello's record (a client that does not wait) is
		// not the parser's business.
		if h, err := ParseClientHello(append(append([]byte{}, b...), 23, 3, 3, 0, 1, 0)); err != nil || h.Len != len(b) {
			t.Errorf("%s with a record after it: %+v, %v", cfg.ServerName, h, err)
		}
	}
	// An IP address: crypto/tls sends no server_name.
	b := realHello(t, &tls.Config{ServerName: "127.0.0.1"})
	if h, err := ParseClientHello(b); err != nil || h.ServerName != "" {
		t.Errorf("hello to an IP address: %+v, %v", h, err)
	}
}

func tlsRecord(typ byte, payload []byte) []byte {
	return append([]byte{typ, 3, 1, byte(len(payload) >> 8), byte(len(payload))}, payload...)
}

// hello builds a ClientHello record from extensions.
func hello(exts ...[]byte) []byte {
	body := []byte{3, 3}
	body = append(body, make([]byte, 32)...) // random
	body = append(body, 0)                   // session id
	body = append(body, 0, 2, 0x13, 0x01)    // one suite
	body = append(body, 1, 0)                // null compression
	var all []byte
	for _, e := range exts {
		all = append(all, e...)
	}
	body = append(body, byte(len(all)>>8), byte(len(all)))
	body = append(body, all...)
	msg := append([]byte{1, byte(len(body) >> 16), byte(len(body) >> 8), byte(len(body))}, body...)
	return tlsRecord(22, msg)
}

func ext(typ uint16, data []byte) []byte {
	return append([]byte{byte(typ >> 8), byte(typ), byte(len(data) >> 8), byte(len(data))}, data...)
}

func sniExt(names ...string) []byte {
	var list []byte
	for _, n := range names {
		list = append(list, 0, byte(len(n)>>8), byte(len(n)))
		list = append(list, n...)
	}
	return ext(0, append([]byte{byte(len(list) >> 8), byte(len(list))}, list...))
}

func TestParseClientHelloRefuses(t *testing.T) {
	if h, err := ParseClientHello(hello(sniExt("ok.test"), ext(0xfe0d, []byte{1, 2}))); err != nil || h.ServerName != "ok.test" || !h.ECH {
		t.Errorf("with ECH: %+v, %v", h, err)
	}
	if h, err := ParseClientHello(hello()); err != nil || h.ServerName != "" {
		t.Errorf("no extensions: %+v, %v", h, err)
	}
	for _, b := range [][]byte{[]byte("GET / HTTP/1.1\r\n"), {0x05, 0x01}, {0x17, 3, 3}, {'S', 'S', 'H'}} {
		if _, err := ParseClientHello(b); !errors.Is(err, ErrNotTLS) {
			t.Errorf("%q: %v, want ErrNotTLS", b, err)
		}
	}
	good := hello(sniExt("ok.test"))
	bad := map[string][]byte{
		"two names":           hello(sniExt("a.test", "b.test")),
		"two sni extensions":  hello(sniExt("a.test"), sniExt("a.test")),
		"empty name":          hello(sniExt("")),
		"NUL in name":         hello(sniExt("a\x00.test")),
		"unicode name":        hello(sniExt("ä.test")),
		"empty sni list":      hello(ext(0, []byte{0, 0})),
		"server hello":        func() []byte { b := append([]byte{}, good...); b[5] = 2; return b }(),
		"record version 2":    func() []byte { b := append([]byte{}, good...); b[1] = 2; return b }(),
		"hello version 2":     func() []byte { b := append([]byte{}, good...); b[9] = 2; return b }(),
		"empty record":        {22, 3, 1, 0, 0},
		"huge record":         {22, 3, 1, 0xff, 0xff},
		"huge hello":          tlsRecord(22, []byte{1, 0x10, 0, 0}),
		"alert inside":        append(tlsRecord(22, good[5:20]), tlsRecord(21, []byte{2, 40})...),
		"extension overrun":   func() []byte { b := append([]byte{}, good...); b[len(b)-len("ok.test")-6]++; return b }(),
		"trailing in message": tlsRecord(22, append(append([]byte{}, good[5:]...), 0)),
	}
	for name, b := range bad {
		h, err := ParseClientHello(b)
		if !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: %+v, %v; want ErrMalformed", name, h, err)
		}
	}
}

// FuzzParseClientHello: the parser never panics or reads past its cap;
// a hello it accepts is a prefix it accounts for, whose proper prefixes
// are incomplete; and crypto/tls's hellos for fuzzed names give the name.
func FuzzParseClientHello(f *testing.F) {
	f.Add(realHello(f, &tls.Config{ServerName: "allowed.test"}), "allowed.test")
	f.Add(realHello(f, &tls.Config{ServerName: "old.test", MaxVersion: tls.VersionTLS12}), "old.test")
	f.Add(hello(sniExt("a.test", "b.test")), "")
	f.Add(hello(), "x")
	f.Add([]byte{22, 3, 1, 0, 4, 1, 0, 0, 0}, "")
	f.Add([]byte("GET /"), "")
	f.Fuzz(func(t *testing.T, b []byte, name string) {
		h, err := ParseClientHello(b)
		switch {
		case err == nil:
			if h.Len <= 0 || h.Len > len(b) || h.Len > MaxClientHelloBytes {
				t.Fatalf("Len %d of %d bytes", h.Len, len(b))
			}
			if h2, err := ParseClientHello(b[:h.Len]); err != nil || h2 != h {
				t.Fatalf("the hello alone: %+v, %v; whole %+v", h2, err, h)
			}
			if _, err := ParseClientHello(b[:h.Len-1]); !errors.Is(err, ErrNeedMore) {
				t.Fatalf("a byte short: %v", err)
			}
			for _, c := range []byte(h.ServerName) {
				if c < '-' || c > 'z' {
					t.Fatalf("server name %q", h.ServerName)
				}
			}
		case errors.Is(err, ErrNeedMore), errors.Is(err, ErrNotTLS), errors.Is(err, ErrMalformed):
		default:
			t.Fatalf("error %v wraps none of the sentinels", err)
		}
		if len(name) == 0 || len(name) > 64 {
			return
		}
		for _, c := range []byte(name) {
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '.' || c == '-') {
				return
			}
		}
		if name[0] == '.' || name[len(name)-1] == '.' || bytes.Contains([]byte(name), []byte("..")) || net.ParseIP(name) != nil {
			return
		}
		real := realHello(t, &tls.Config{ServerName: name})
		if h, err := ParseClientHello(real); err != nil || h.ServerName != name {
			t.Fatalf("crypto/tls's hello for %q: %+v, %v", name, h, err)
		}
	})
}
