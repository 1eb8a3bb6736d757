package egress

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// fakeHost stands in for carreld: it holds the Requests stream open and
// answers each request as decide says, dialling the address decide names
// for an allowed one and carrying its bytes.
type fakeHost struct {
	client agentv1connect.EgressServiceClient
	decide func(*agentv1.EgressDialRequest) (outcome agentv1.EgressOutcome, reason, dial string)

	mu   sync.Mutex
	seen []*agentv1.EgressDialRequest
}

func (h *fakeHost) requests() []*agentv1.EgressDialRequest {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]*agentv1.EgressDialRequest(nil), h.seen...)
}

func (h *fakeHost) run(ctx context.Context) {
	s, err := h.client.Requests(ctx, connect.NewRequest(&agentv1.EgressRequestsRequest{}))
	if err != nil {
		return
	}
	for s.Receive() {
		m := s.Msg()
		h.mu.Lock()
		h.seen = append(h.seen, m)
		h.mu.Unlock()
		go h.answer(ctx, m)
	}
}

func (h *fakeHost) answer(ctx context.Context, req *agentv1.EgressDialRequest) {
	outcome, reason, addr := h.decide(req)
	var up net.Conn
	if outcome == agentv1.EgressOutcome_EGRESS_OUTCOME_ALLOWED {
		var err error
		if up, err = net.Dial("tcp", addr); err != nil {
			outcome, reason = agentv1.EgressOutcome_EGRESS_OUTCOME_FAILED, err.Error()
		} else {
			defer up.Close()
		}
	}
	bs := h.client.Connect(ctx)
	defer bs.CloseResponse()
	bs.Send(&agentv1.EgressData{Msg: &agentv1.EgressData_Verdict{Verdict: &agentv1.EgressVerdict{Id: req.Id, Outcome: outcome, Reason: reason}}})
	if outcome != agentv1.EgressOutcome_EGRESS_OUTCOME_ALLOWED {
		bs.CloseRequest()
		bs.Receive()
		return
	}
	go func() {
		buf := make([]byte, 16<<10)
		for {
			n, err := up.Read(buf)
			if n > 0 && bs.Send(&agentv1.EgressData{Msg: &agentv1.EgressData_Data{Data: buf[:n]}}) != nil {
				return
			}
			if err != nil {
				bs.Send(&agentv1.EgressData{Msg: &agentv1.EgressData_Close{Close: &agentv1.EgressClose{}}})
				bs.CloseRequest()
				return
			}
		}
	}()
	for {
		m, err := bs.Receive()
		if err != nil {
			return
		}
		switch x := m.Msg.(type) {
		case *agentv1.EgressData_Data:
			up.Write(x.Data)
		case *agentv1.EgressData_Close:
			up.(*net.TCPConn).CloseWrite()
		}
	}
}

// rig is a Service with its proxies on loopback ports, served to a fake
// host over a unix socket the way carrel-agent serves carreld.
type rig struct {
	svc        *Service
	host       *fakeHost
	httpProxy  string
	socksProxy string
	client     agentv1connect.EgressServiceClient
}

func newRig(t *testing.T, opts Options, decide func(*agentv1.EgressDialRequest) (agentv1.EgressOutcome, string, string)) *rig {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	svc := New(opts)
	sock := filepath.Join(t.TempDir(), "agent.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle(agentv1connect.NewEgressServiceHandler(svc, protocol.HandlerOptions()...))
	srv := protocol.NewHTTPServer(mux)
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	hc, tr := protocol.NewHTTPClient(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	})
	t.Cleanup(tr.CloseIdleConnections)
	r := &rig{svc: svc, client: agentv1connect.NewEgressServiceClient(hc, protocol.BaseURL, protocol.ClientOptions()...)}
	for _, p := range []struct {
		addr  *string
		serve func(context.Context, net.Listener) error
	}{{&r.httpProxy, svc.ServeHTTPProxy}, {&r.socksProxy, svc.ServeSOCKS5}} {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		*p.addr = l.Addr().String()
		go p.serve(ctx, l)
	}
	if decide != nil {
		r.host = &fakeHost{client: r.client, decide: decide}
		go r.host.run(ctx)
	}
	return r
}

// proxied is an http.Client that uses the rig's HTTP proxy for every
// request, and trusts the test TLS server.
func (r *rig) proxied(tlsSrv *httptest.Server) *http.Client {
	u, _ := url.Parse("http://" + r.httpProxy)
	tr := &http.Transport{Proxy: http.ProxyURL(u), DisableKeepAlives: true}
	if tlsSrv != nil {
		tr.TLSClientConfig = &tls.Config{RootCAs: tlsSrv.Client().Transport.(*http.Transport).TLSClientConfig.RootCAs, ServerName: "example.com"}
	}
	return &http.Client{Transport: tr, Timeout: 20 * time.Second}
}

const (
	allowed = agentv1.EgressOutcome_EGRESS_OUTCOME_ALLOWED
	denied  = agentv1.EgressOutcome_EGRESS_OUTCOME_DENIED
	failed  = agentv1.EgressOutcome_EGRESS_OUTCOME_FAILED
)

// decideByHost allows allowed.test (to upstream), fails broken.test, and
// denies the rest.
func decideByHost(upstream string) func(*agentv1.EgressDialRequest) (agentv1.EgressOutcome, string, string) {
	return func(r *agentv1.EgressDialRequest) (agentv1.EgressOutcome, string, string) {
		switch r.Host {
		case "allowed.test", "127.0.0.7", "::7":
			return allowed, "", upstream
		case "broken.test":
			return failed, "resolve broken.test: no such host", ""
		}
		return denied, "carrel.net.default_deny: egress to " + r.Host + ": not in settings.net.egress_allow", ""
	}
}

func TestHTTPConnectAllowed(t *testing.T) {
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "tls hello %s", r.URL.Path)
	}))
	defer srv.Close()
	r := newRig(t, Options{}, decideByHost(srv.Listener.Addr().String()))
	resp, err := r.proxied(srv).Get("https://allowed.test:8443/x")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(body) != "tls hello /x" {
		t.Fatalf("GET through CONNECT: %s %q", resp.Status, body)
	}
	reqs := r.host.requests()
	if len(reqs) != 1 {
		t.Fatalf("carreld got %d requests, want 1", len(reqs))
	}
	q := reqs[0]
	if q.Host != "allowed.test" || q.Port != 8443 || q.Kind != agentv1.EgressKind_EGRESS_KIND_HTTP_CONNECT || q.Id == 0 {
		t.Errorf("request %v", q)
	}
	if q.Pid != int32(os.Getpid()) {
		t.Errorf("request names pid %d, want this process, %d", q.Pid, os.Getpid())
	}
}

func TestPlainHTTPRewritten(t *testing.T) {
	var got *http.Request
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got = r
		body, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "got %s %q", r.Method, body)
	}))
	defer srv.Close()
	r := newRig(t, Options{}, decideByHost(srv.Listener.Addr().String()))
	req, _ := http.NewRequest("POST", "http://allowed.test/p?q=1", strings.NewReader("payload"))
	req.Header.Set("X-Keep", "yes")
	req.Header.Set("Proxy-Authorization", "Basic c2VjcmV0")
	req.Header.Set("Connection", "X-Drop")
	req.Header.Set("X-Drop", "hop")
	resp, err := r.proxied(nil).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(body) != `got POST "payload"` {
		t.Fatalf("POST through the proxy: %s %q", resp.Status, body)
	}
	if got.RequestURI != "/p?q=1" || got.Host != "allowed.test" || !got.Close || got.Header.Get("X-Keep") != "yes" ||
		got.Header.Get("Proxy-Authorization") != "" || got.Header.Get("X-Drop") != "" {
		t.Errorf("the origin server got %s %s, Host %s, close %v, header %v", got.Method, got.RequestURI, got.Host, got.Close, got.Header)
	}
	if q := r.host.requests(); len(q) != 1 || q[0].Kind != agentv1.EgressKind_EGRESS_KIND_HTTP || q[0].Port != 80 {
		t.Errorf("requests %v", q)
	}
}

func TestHTTPRefusals(t *testing.T) {
	r := newRig(t, Options{}, decideByHost("127.0.0.1:1"))
	for _, c := range []struct {
		url    string
		status int
		body   string
	}{
		{"http://denied.test/", 403, "carrel egress: denied.test:80 denied: carrel.net.default_deny: egress to denied.test: not in settings.net.egress_allow"},
		{"http://broken.test:81/", 502, "carrel egress: broken.test:81 failed: resolve broken.test: no such host"},
		// Allowed, but nothing listens at the upstream: the dial fails.
		{"http://allowed.test/", 502, "carrel egress: allowed.test:80 failed: dial tcp 127.0.0.1:1"},
	} {
		resp, err := r.proxied(nil).Get(c.url)
		if err != nil {
			t.Errorf("GET %s: %v", c.url, err)
			continue
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != c.status || !strings.HasPrefix(string(body), c.body) {
			t.Errorf("GET %s: %s %q; want %d %q", c.url, resp.Status, body, c.status, c.body)
		}
	}
	// CONNECT to a denied host: 403 with the reason, read raw.
	c, err := net.Dial("tcp", r.httpProxy)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "CONNECT denied.test:443 HTTP/1.1\r\nHost: denied.test:443\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 403 || !strings.Contains(string(body), "denied.test:443 denied: carrel.net.default_deny") {
		t.Errorf("CONNECT denied.test: %s %q", resp.Status, body)
	}
}

func TestBadProxyRequests(t *testing.T) {
	r := newRig(t, Options{}, decideByHost("127.0.0.1:1"))
	for _, req := range []string{
		"GET /relative HTTP/1.1\r\nHost: x\r\n\r\n",
		"GET https://allowed.test/ HTTP/1.1\r\n\r\n",
		"GET ftp://allowed.test/ HTTP/1.1\r\n\r\n",
		"CONNECT allowed.test HTTP/1.1\r\n\r\n",
		"CONNECT allowed.test:0 HTTP/1.1\r\n\r\n",
		"CONNECT allowed.test:99999 HTTP/1.1\r\n\r\n",
		"CONNECT bad\x01host:443 HTTP/1.1\r\n\r\n",
		"CONNECT :443 HTTP/1.1\r\n\r\n",
		"NONSENSE\r\n\r\n",
		"GET http://allowed.test/ HTTP/2.0\r\n\r\n",
		"GET http://allowed.test/ HTTP/1.1\r\n" + strings.Repeat("X-Big: "+strings.Repeat("a", 1000)+"\r\n", 80) + "\r\n",
	} {
		c, err := net.Dial("tcp", r.httpProxy)
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(10 * time.Second))
		io.WriteString(c, req)
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil || resp.StatusCode != 400 {
			t.Errorf("%.60q: %v, %v; want 400", req, resp, err)
		}
		c.Close()
	}
	if n := len(r.host.requests()); n != 0 {
		t.Errorf("bad requests reached carreld: %d", n)
	}
}

// socksDial runs a SOCKS5 CONNECT on c and returns the reply code.
func socksDial(t *testing.T, c net.Conn, atyp []byte, port uint16) byte {
	t.Helper()
	c.SetDeadline(time.Now().Add(20 * time.Second))
	c.Write([]byte{5, 1, 0})
	var m [2]byte
	if _, err := io.ReadFull(c, m[:]); err != nil || m != [2]byte{5, 0} {
		t.Fatalf("greeting: %v %v", m, err)
	}
	req := append(append([]byte{5, 1, 0}, atyp...), byte(port>>8), byte(port))
	c.Write(req)
	var rep [10]byte
	if _, err := io.ReadFull(c, rep[:]); err != nil {
		t.Fatalf("reply: %v", err)
	}
	return rep[1]
}

func domain(h string) []byte { return append([]byte{3, byte(len(h))}, h...) }

func TestSOCKS5(t *testing.T) {
	echo, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer echo.Close()
	go func() {
		for {
			c, err := echo.Accept()
			if err != nil {
				return
			}
			go func() { io.Copy(c, c); c.Close() }()
		}
	}()
	r := newRig(t, Options{}, decideByHost(echo.Addr().String()))
	for name, atyp := range map[string][]byte{
		"domain": domain("allowed.test"),
		"ipv4":   {1, 127, 0, 0, 7},
		"ipv6":   append([]byte{4}, netip.MustParseAddr("::7").AsSlice()...),
	} {
		c, err := net.Dial("tcp", r.socksProxy)
		if err != nil {
			t.Fatal(err)
		}
		if code := socksDial(t, c, atyp, 7); code != 0 {
			t.Errorf("%s: reply %d, want 0", name, code)
			c.Close()
			continue
		}
		io.WriteString(c, "ping "+name)
		c.(*net.TCPConn).CloseWrite()
		got, err := io.ReadAll(c)
		if err != nil || string(got) != "ping "+name {
			t.Errorf("%s: echoed %q, %v", name, got, err)
		}
		c.Close()
	}
	for _, c := range []struct {
		atyp []byte
		want byte
	}{
		{domain("denied.test"), 2},
		{domain("broken.test"), 4},
	} {
		conn, err := net.Dial("tcp", r.socksProxy)
		if err != nil {
			t.Fatal(err)
		}
		if code := socksDial(t, conn, c.atyp, 443); code != c.want {
			t.Errorf("%q: reply %d, want %d", c.atyp, code, c.want)
		}
		conn.Close()
	}
	kinds := map[string]agentv1.EgressKind{}
	for _, q := range r.host.requests() {
		kinds[q.Host] = q.Kind
	}
	for _, h := range []string{"allowed.test", "127.0.0.7", "::7", "denied.test"} {
		if kinds[h] != agentv1.EgressKind_EGRESS_KIND_SOCKS5 {
			t.Errorf("request for %s: kind %v", h, kinds[h])
		}
	}
}

func TestSOCKS5Refusals(t *testing.T) {
	r := newRig(t, Options{}, decideByHost("127.0.0.1:1"))
	dial := func() net.Conn {
		c, err := net.Dial("tcp", r.socksProxy)
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(10 * time.Second))
		t.Cleanup(func() { c.Close() })
		return c
	}
	// Only username/password offered: no acceptable method.
	c := dial()
	c.Write([]byte{5, 1, 2})
	var m [2]byte
	if _, err := io.ReadFull(c, m[:]); err != nil || m != [2]byte{5, 0xff} {
		t.Errorf("auth only: %v %v", m, err)
	}
	for _, x := range []struct {
		req  []byte
		want byte
	}{
		{[]byte{5, 2, 0, 3, 1, 'a', 0, 80}, 7}, // BIND
		{[]byte{5, 1, 0, 9, 0, 80}, 8},         // unknown address type
		{append(append([]byte{5, 1, 0}, domain("a\x00b")...), 0, 80), 1},
		{append(append([]byte{5, 1, 0}, domain("allowed.test")...), 0, 0), 1}, // port 0
	} {
		c := dial()
		c.Write([]byte{5, 1, 0})
		io.ReadFull(c, m[:])
		c.Write(x.req)
		var rep [10]byte
		if _, err := io.ReadFull(c, rep[:]); err != nil || rep[1] != x.want {
			t.Errorf("request %v: reply %v, %v; want %d", x.req, rep, err, x.want)
		}
	}
	// Not SOCKS5 at all: closed.
	c = dial()
	c.Write([]byte{4, 1, 0, 80, 1, 2, 3, 4, 0})
	if b, err := io.ReadAll(c); len(b) != 0 {
		t.Errorf("SOCKS4: got %v, %v", b, err)
	}
	if n := len(r.host.requests()); n != 0 {
		t.Errorf("refused requests reached carreld: %d", n)
	}
}

// TestUnansweredTimesOut: with no carreld listening, a request fails with
// 504 (SOCKS5 reply 1) after the timeout, and does not hang.
func TestUnansweredTimesOut(t *testing.T) {
	r := newRig(t, Options{Timeout: 300 * time.Millisecond}, nil)
	start := time.Now()
	resp, err := r.proxied(nil).Get("http://allowed.test/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 504 || !strings.Contains(string(body), "carreld did not answer") {
		t.Errorf("unanswered GET: %s %q", resp.Status, body)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("took %v", d)
	}
	c, err := net.Dial("tcp", r.socksProxy)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if code := socksDial(t, c, domain("allowed.test"), 443); code != 1 {
		t.Errorf("unanswered SOCKS5: reply %d, want 1", code)
	}
	// Given up on while queued: a host that connects later is not sent
	// the stale requests.
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	s, err := r.client.Requests(ctx, connect.NewRequest(&agentv1.EgressRequestsRequest{}))
	if err == nil {
		for s.Receive() {
			t.Errorf("a stale request was sent: %v", s.Msg())
		}
	}
}

func TestBusy(t *testing.T) {
	svc := New(Options{Timeout: time.Minute})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for range MaxWaiting {
		wg.Go(func() { svc.ask(ctx, "a.test", 443, agentv1.EgressKind_EGRESS_KIND_SOCKS5, 0) })
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		svc.mu.Lock()
		n := len(svc.waiting)
		svc.mu.Unlock()
		if n == MaxWaiting {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d waiting", n)
		}
		time.Sleep(time.Millisecond)
	}
	if _, err := svc.ask(context.Background(), "a.test", 443, agentv1.EgressKind_EGRESS_KIND_SOCKS5, 0); !errors.Is(err, ErrBusy) {
		t.Errorf("request %d: %v, want ErrBusy", MaxWaiting+1, err)
	}
	cancel()
	wg.Wait()
	if len(svc.waiting) != 0 {
		t.Errorf("%d still waiting after every caller gave up", len(svc.waiting))
	}
}

func TestConnectRefusesBadCalls(t *testing.T) {
	r := newRig(t, Options{}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, c := range []struct {
		first *agentv1.EgressData
		code  connect.Code
	}{
		{&agentv1.EgressData{Msg: &agentv1.EgressData_Verdict{Verdict: &agentv1.EgressVerdict{Id: 42, Outcome: allowed}}}, connect.CodeNotFound},
		{&agentv1.EgressData{Msg: &agentv1.EgressData_Data{Data: []byte("x")}}, connect.CodeInvalidArgument},
	} {
		bs := r.client.Connect(ctx)
		bs.Send(c.first)
		bs.CloseRequest()
		if _, err := bs.Receive(); connect.CodeOf(err) != c.code {
			t.Errorf("Connect starting with %v: %v, want %v", c.first, err, c.code)
		}
		bs.CloseResponse()
	}
}

func TestEnv(t *testing.T) {
	env := strings.Join(Env(), "\n")
	for _, want := range []string{"HTTP_PROXY=http://127.0.0.1:3128", "HTTPS_PROXY=http://127.0.0.1:3128", "ALL_PROXY=socks5h://127.0.0.1:1080",
		"https_proxy=http://127.0.0.1:3128", "NO_PROXY=localhost,127.0.0.1,::1"} {
		if !strings.Contains(env, want+"\n") && !strings.HasSuffix(env, want) {
			t.Errorf("Env has no %s:\n%s", want, env)
		}
	}
}

func TestPeerPID(t *testing.T) {
	for _, network := range []string{"tcp4", "tcp6"} {
		addr := "127.0.0.1:0"
		if network == "tcp6" {
			addr = "[::1]:0"
		}
		l, err := net.Listen(network, addr)
		if err != nil {
			t.Logf("%s: %v", network, err)
			continue
		}
		c, err := net.Dial(network, l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		s, err := l.Accept()
		if err != nil {
			t.Fatal(err)
		}
		if pid := PeerPID(s.RemoteAddr().String(), s.LocalAddr().String()); pid != int32(os.Getpid()) {
			t.Errorf("%s: PeerPID = %d, want %d", network, pid, os.Getpid())
		}
		c.Close()
		s.Close()
		l.Close()
	}
	if pid := PeerPID("127.0.0.1:1", "127.0.0.1:2"); pid != 0 {
		t.Errorf("PeerPID of no connection = %d", pid)
	}
	if pid := PeerPID("nonsense", ""); pid != 0 {
		t.Errorf("PeerPID of nonsense = %d", pid)
	}
}
