package egress

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/textproto"
	"net/url"
	"strconv"
	"strings"
	"time"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

// ServeHTTPProxy serves the HTTP proxy on l until ctx ends or accepting
// fails; l is closed when it returns. Each connection carries one CONNECT
// tunnel or one plain http:// request (answered with "Connection: close").
func (s *Service) ServeHTTPProxy(ctx context.Context, l net.Listener) error {
	return serve(ctx, l, s.serveHTTPConn)
}

// serve accepts on l and runs handle for each connection.
func serve(ctx context.Context, l net.Listener, handle func(context.Context, halfCloser)) error {
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	defer l.Close()
	for {
		c, err := l.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			return err
		}
		hc, ok := c.(halfCloser)
		if !ok {
			c.Close()
			continue
		}
		if tc, ok := c.(*net.TCPConn); ok {
			// Whole data messages fit: fewer switches between the agent
			// and the program, which share one vCPU under TCG.
			tc.SetWriteBuffer(1 << 20)
		}
		go handle(ctx, hc)
	}
}

// proxyRequest is the head of a program's request to the HTTP proxy.
type proxyRequest struct {
	method, target, proto string
	header                textproto.MIMEHeader
}

// readProxyRequest reads a request line and header block of at most
// maxHeaderBytes.
func readProxyRequest(br *bufio.Reader) (*proxyRequest, error) {
	tp := textproto.NewReader(br)
	line, err := tp.ReadLine()
	if err != nil {
		return nil, err
	}
	method, rest, ok1 := strings.Cut(line, " ")
	target, proto, ok2 := strings.Cut(rest, " ")
	if !ok1 || !ok2 || method == "" || target == "" || !strings.HasPrefix(proto, "HTTP/1.") || len(proto) != len("HTTP/1.1") {
		return nil, fmt.Errorf("malformed request line %.80q", line)
	}
	h, err := tp.ReadMIMEHeader()
	if err != nil {
		return nil, fmt.Errorf("malformed header: %w", err)
	}
	return &proxyRequest{method: method, target: target, proto: proto, header: h}, nil
}

// hopByHop are the headers that concern only the program's connection to
// the proxy. Transfer-Encoding stays: the body passes through unchanged.
var hopByHop = []string{"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authorization", "Proxy-Authenticate", "Te", "Trailer", "Upgrade"}

// originForm is the request as the origin server gets it: origin-form
// target, Host from the absolute URL, hop-by-hop headers (and those the
// Connection header names) dropped, and "Connection: close".
func (r *proxyRequest) originForm(u *url.URL) []byte {
	h := textproto.MIMEHeader{}
	for k, v := range r.header {
		h[k] = v
	}
	for _, c := range r.header.Values("Connection") {
		for _, name := range strings.Split(c, ",") {
			h.Del(strings.TrimSpace(name))
		}
	}
	for _, k := range hopByHop {
		h.Del(k)
	}
	h.Del("Host")
	var b bytes.Buffer
	fmt.Fprintf(&b, "%s %s %s\r\nHost: %s\r\n", r.method, u.RequestURI(), r.proto, u.Host)
	for k, vs := range h {
		for _, v := range vs {
			fmt.Fprintf(&b, "%s: %s\r\n", k, v)
		}
	}
	b.WriteString("Connection: close\r\n\r\n")
	return b.Bytes()
}

func (s *Service) serveHTTPConn(ctx context.Context, c halfCloser) {
	defer c.Close()
	start := time.Now()
	c.SetReadDeadline(start.Add(handshakeTimeout))
	lr := &io.LimitedReader{R: c, N: maxHeaderBytes}
	br := bufio.NewReaderSize(lr, 16<<10)
	req, err := readProxyRequest(br)
	if lr.N <= 0 {
		err = fmt.Errorf("request header over %d bytes", maxHeaderBytes)
	}
	if err != nil {
		if !errors.Is(err, io.EOF) { // EOF: the program sent nothing, or gave up
			httpError(c, 400, "Bad Request", fmt.Sprintf("carrel egress proxy: %v", err))
		}
		return
	}
	c.SetReadDeadline(time.Time{})
	lr.N = math.MaxInt64 // the header is in; a body may be long

	var host, port string
	var kind agentv1.EgressKind
	var head []byte // sent first, for a plain http request
	if req.method == "CONNECT" {
		kind = agentv1.EgressKind_EGRESS_KIND_HTTP_CONNECT
		host, port, err = net.SplitHostPort(req.target)
	} else {
		kind = agentv1.EgressKind_EGRESS_KIND_HTTP
		var u *url.URL
		u, err = url.ParseRequestURI(req.target)
		switch {
		case err != nil:
		case !strings.EqualFold(u.Scheme, "http") || u.Host == "":
			err = errors.New("not an absolute http:// URL: send CONNECT host:port for https, and other schemes through SOCKS5")
		default:
			host, port = u.Hostname(), u.Port()
			if port == "" {
				port = "80"
			}
			head = req.originForm(u)
		}
	}
	p, perr := parsePort(port)
	if err == nil {
		err = perr
	}
	if err == nil {
		err = checkHost(host)
	}
	if err != nil {
		httpError(c, 400, "Bad Request", fmt.Sprintf("carrel egress proxy: %s %.200s: %v", req.method, req.target, err))
		return
	}

	pid := s.opts.PID(c.RemoteAddr().String(), c.LocalAddr().String())
	log := s.opts.Log.With("subsystem", "egress", "proxy", "http", "host", host, "port", p, "kind", kind.String(), "pid", pid)
	a, err := s.ask(ctx, host, p, kind, pid)
	switch {
	case errors.Is(err, ErrBusy):
		httpError(c, 503, "Service Unavailable", "carrel egress proxy: "+err.Error())
		log.Info("egress refused", "err", err)
		return
	case err != nil:
		httpError(c, 504, "Gateway Timeout", fmt.Sprintf("carrel egress proxy: %s:%d: %v (within %v)", host, p, err, s.opts.Timeout))
		log.Info("egress timed out", "err", err)
		return
	}
	switch a.verdict.Outcome {
	case agentv1.EgressOutcome_EGRESS_OUTCOME_ALLOWED:
	case agentv1.EgressOutcome_EGRESS_OUTCOME_DENIED:
		httpError(c, 403, "Forbidden", fmt.Sprintf("carrel egress: %s:%d denied: %s", host, p, a.verdict.Reason))
		log.Info("egress denied", "reason", a.verdict.Reason)
		return
	default:
		httpError(c, 502, "Bad Gateway", fmt.Sprintf("carrel egress: %s:%d failed: %s", host, p, a.verdict.Reason))
		log.Info("egress failed", "reason", a.verdict.Reason)
		return
	}

	var r io.Reader = br // bytes the program sent after its header, then the rest
	if kind == agentv1.EgressKind_EGRESS_KIND_HTTP_CONNECT {
		if _, err := io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
			a.tunnel.finish(err)
			return
		}
	} else {
		r = io.MultiReader(bytes.NewReader(head), br)
	}
	up, down, err := pump(a.tunnel, c, r)
	a.tunnel.finish(err)
	log.Debug("egress connection ended", "bytes_up", up, "bytes_down", down, "duration", time.Since(start), "err", err)
}

// httpError answers a program with status and a plain-text reason, and
// "Connection: close". It then reads (and drops) what the program still
// sends, for a moment: closing with unread bytes would reset the
// connection, and the program might never read the answer.
func httpError(c halfCloser, code int, status, body string) {
	c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	body += "\n"
	fmt.Fprintf(c, "HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", code, status, len(body), body)
	c.CloseWrite()
	c.SetReadDeadline(time.Now().Add(2 * time.Second))
	io.Copy(io.Discard, io.LimitReader(c, 1<<20))
}

func parsePort(s string) (uint16, error) {
	p, err := strconv.ParseUint(s, 10, 16)
	if err != nil || p == 0 {
		return 0, fmt.Errorf("port %.16q is not 1-65535", s)
	}
	return uint16(p), nil
}

// checkHost refuses what carreld would refuse anyway, before it is asked:
// an empty or overlong host, or bytes outside the characters of names and
// IP addresses.
func checkHost(h string) error {
	if h == "" || len(h) > 255 {
		return fmt.Errorf("host %.64q: empty or longer than 255 bytes", h)
	}
	for i := 0; i < len(h); i++ {
		c := h[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '-' || c == ':' || c == '_') {
			return fmt.Errorf("host %.64q has a character outside [A-Za-z0-9.-:_]", h)
		}
	}
	return nil
}
