package egress

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
)

// A tunnel whose first bytes are a plain HTTP/1.x request is checked as a
// ClientHello is: the request's Host (and an absolute target's host) must
// be the host the tunnel was decided for, or nothing of it leaves the
// host. The head goes upstream with "Connection: close", so the tunnel
// carries that one request: a second one, which nothing checks, is not
// read by a server that honours it.

// MaxRequestHeadBytes caps what is buffered while a request's head is
// read.
const MaxRequestHeadBytes = 64 << 10

var (
	// ErrNotHTTP: the bytes do not start an HTTP/1.x request line.
	ErrNotHTTP = errors.New("not an HTTP/1.x request")
	// ErrHeadNeedMore: the bytes start a request whose head is not
	// complete yet.
	ErrHeadNeedMore = errors.New("incomplete request head")
)

// RequestHead is what the check needs of a request's head.
type RequestHead struct {
	Method, Target, Proto string
	// Hosts are the values of every Host header, as sent.
	Hosts []string
	// Len is how many bytes of the input the head took, its blank line
	// included.
	Len int
	// lines are the head's header lines, for the rewrite.
	lines []string
}

// ParseRequestHead reads an HTTP/1.x request head from the start of b. It
// returns ErrNotHTTP as soon as b cannot begin a request line,
// ErrHeadNeedMore while the head is incomplete, and another error for a
// head that is malformed or over MaxRequestHeadBytes.
func ParseRequestHead(b []byte) (RequestHead, error) {
	// The method: 1 to 16 upper-case letters, then a space.
	for i := 0; ; i++ {
		if i == len(b) {
			return RequestHead{}, ErrHeadNeedMore
		}
		c := b[i]
		if c == ' ' && i > 0 {
			break
		}
		if c < 'A' || c > 'Z' || i >= 16 {
			return RequestHead{}, ErrNotHTTP
		}
	}
	// A first line that is not a request line is another protocol.
	if i := bytes.Index(b, []byte("\r\n")); i >= 0 {
		line := b[:i]
		if !bytes.HasSuffix(line, []byte(" HTTP/1.1")) && !bytes.HasSuffix(line, []byte(" HTTP/1.0")) {
			return RequestHead{}, ErrNotHTTP
		}
	}
	end := bytes.Index(b, []byte("\r\n\r\n"))
	if end < 0 {
		if len(b) > MaxRequestHeadBytes {
			return RequestHead{}, fmt.Errorf("a request head over %d bytes", MaxRequestHeadBytes)
		}
		if i := bytes.Index(b, []byte("\r\n")); i < 0 && len(b) > 8<<10 {
			return RequestHead{}, errors.New("a request line over 8 KiB")
		}
		return RequestHead{}, ErrHeadNeedMore
	}
	if end+4 > MaxRequestHeadBytes {
		return RequestHead{}, fmt.Errorf("a request head over %d bytes", MaxRequestHeadBytes)
	}
	lines := strings.Split(string(b[:end]), "\r\n")
	parts := strings.Split(lines[0], " ")
	if len(parts) != 3 || parts[1] == "" || (parts[2] != "HTTP/1.1" && parts[2] != "HTTP/1.0") {
		return RequestHead{}, fmt.Errorf("a malformed request line %.100q", lines[0])
	}
	h := RequestHead{Method: parts[0], Target: parts[1], Proto: parts[2], Len: end + 4, lines: lines[1:]}
	for _, l := range h.lines {
		name, value, ok := strings.Cut(l, ":")
		if !ok || name == "" || strings.ContainsAny(name, " \t") || strings.ContainsAny(l, "\r\n\x00") {
			return RequestHead{}, fmt.Errorf("a malformed header line %.100q", l)
		}
		if strings.EqualFold(name, "Host") {
			h.Hosts = append(h.Hosts, strings.TrimSpace(value))
		}
	}
	return h, nil
}

// Hosts0 is the first Host header's value, "" when there is none.
func (h RequestHead) Hosts0() string {
	if len(h.Hosts) == 0 {
		return ""
	}
	return h.Hosts[0]
}

// checkHead returns why a request may not go to host:port, or "".
func checkHead(h RequestHead, host string, port uint32) string {
	if len(h.Hosts) != 1 {
		return fmt.Sprintf("an HTTP request with %d Host headers in a connection to %s", len(h.Hosts), host)
	}
	if why := checkAuthority("Host header", h.Hosts[0], host, port); why != "" {
		return why
	}
	if !strings.HasPrefix(h.Target, "/") && h.Target != "*" {
		u, err := url.Parse(h.Target)
		if err != nil || u.Host == "" {
			return fmt.Sprintf("an HTTP request target %.100q that is neither a path nor an absolute URL", h.Target)
		}
		return checkAuthority("request target", u.Host, host, port)
	}
	return ""
}

// checkAuthority compares a host[:port] a request names with the host and
// port the connection was decided for.
func checkAuthority(what, authority, host string, port uint32) string {
	name, p, err := net.SplitHostPort(authority)
	if err != nil { // no port
		name, p = strings.Trim(authority, "[]"), ""
	}
	name = strings.TrimSuffix(strings.ToLower(name), ".")
	switch {
	case name != strings.ToLower(host):
		return fmt.Sprintf("HTTP %s %.100q does not match the connection's host %s", what, authority, host)
	case p != "" && p != fmt.Sprint(port):
		return fmt.Sprintf("HTTP %s %.100q names another port than the connection's, %d", what, authority, port)
	}
	return ""
}

// closeHead is the head with "Connection: close" in place of what the
// request said of its connection.
func closeHead(h RequestHead) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "%s %s %s\r\n", h.Method, h.Target, h.Proto)
	for _, l := range h.lines {
		name, _, _ := strings.Cut(l, ":")
		switch strings.ToLower(name) {
		case "connection", "keep-alive", "proxy-connection":
			continue
		}
		b.WriteString(l)
		b.WriteString("\r\n")
	}
	b.WriteString("Connection: close\r\n\r\n")
	return b.Bytes()
}

// httpForbidden answers a refused request.
func httpForbidden(why string) []byte {
	body := "carrel egress: " + why + "\n"
	return fmt.Appendf(nil, "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", len(body), body)
}
