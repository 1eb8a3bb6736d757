package egress

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	guestegress "github.com/carrel-os/carrel/guest-agent/egress"
	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/supervisor/audit"
)

// testPolicies decides with one compiled policy, which a test can swap
// (as `carrel policy apply` does), and keeps every decision.
type testPolicies struct {
	mu        sync.Mutex
	p         *policy.Policy
	decisions []policy.Decision
}

func (t *testPolicies) Decide(ctx context.Context, _ string, in policy.Input) (policy.Decision, error) {
	t.mu.Lock()
	p := t.p
	t.mu.Unlock()
	d, err := p.Decide(ctx, in)
	t.mu.Lock()
	t.decisions = append(t.decisions, d)
	t.mu.Unlock()
	return d, err
}

func (t *testPolicies) Get(string) (*policy.Policy, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.p, nil
}

// set compiles the default policy with settings.net replaced by net.
func (t *testPolicies) set(tb testing.TB, net map[string]any) {
	tb.Helper()
	b, err := policy.Builtin(policy.DefaultName)
	if err != nil {
		tb.Fatal(err)
	}
	var data map[string]map[string]any
	if err := json.Unmarshal(b.Files[policy.DataFile], &data); err != nil {
		tb.Fatal(err)
	}
	data["settings"]["net"] = net
	raw, _ := json.Marshal(data)
	nb, err := policy.FromFiles(map[string][]byte{policy.DataFile: raw})
	if err != nil {
		tb.Fatal(err)
	}
	p, err := policy.Compile(context.Background(), "test", nb)
	if err != nil {
		tb.Fatal(err)
	}
	t.mu.Lock()
	t.p = p
	t.mu.Unlock()
}

// memRecorder keeps records.
type memRecorder struct {
	mu   sync.Mutex
	recs []audit.Record
}

func (m *memRecorder) Append(_ context.Context, r audit.Record) (uint64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.recs = append(m.recs, r)
	return uint64(len(m.recs)), nil
}

// egress returns the net.egress records' data.
func (m *memRecorder) egress(t *testing.T) []audit.Egress {
	t.Helper()
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []audit.Egress
	for _, r := range m.recs {
		if r.Kind != audit.KindNetEgress || r.VM != "demo" || r.Session != "ses_1" || r.Provenance != audit.Host {
			t.Errorf("record %+v", r)
			continue
		}
		var d audit.Egress
		if err := json.Unmarshal(r.Data, &d); err != nil {
			t.Fatal(err)
		}
		out = append(out, d)
	}
	return out
}

// waitRecords waits for n net.egress records (each is written as its
// connection ends).
func (m *memRecorder) waitRecords(t *testing.T, n int) []audit.Egress {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		recs := m.egress(t)
		if len(recs) >= n || time.Now().After(deadline) {
			if len(recs) != n {
				t.Fatalf("%d net.egress records, want %d: %+v", len(recs), n, recs)
			}
			return recs
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// fakeLink reaches a guest egress service on a unix socket.
type fakeLink struct {
	client agentv1connect.EgressServiceClient
}

func (l fakeLink) Egress() (agentv1connect.EgressServiceClient, func(context.Context, error) error) {
	return l.client, func(_ context.Context, err error) error { return err }
}

// countingResolver is Hosts that counts lookups.
type countingResolver struct {
	Hosts
	lookups atomic.Int64
	names   sync.Map
}

func (r *countingResolver) LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error) {
	r.lookups.Add(1)
	r.names.Store(host, true)
	return r.Hosts.LookupNetIP(ctx, network, host)
}

// world is a guest's egress service and proxies (the real ones from
// guest-agent/egress), a Proxy serving them with a test policy and
// resolver, and local servers standing in for the internet.
type world struct {
	proxy    *Proxy
	pols     *testPolicies
	rec      *memRecorder
	resolver *countingResolver
	httpAddr string // the guest's HTTP proxy
	socks    string // the guest's SOCKS5 proxy
	web      *httptest.Server
	tlsWeb   *httptest.Server
	pool     *x509.CertPool
	webPort  int
	tlsPort  int
}

// selfSigned is a certificate for names.
func selfSigned(t testing.TB, names ...string) (tls.Certificate, *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: names[0]}, DNSNames: names,
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, pool
}

func portOf(s *httptest.Server) int {
	return s.Listener.Addr().(*net.TCPAddr).Port
}

// allowLocal is settings.net allowing allowed.test on the test servers'
// ports, with their loopback address named.
func (w *world) allowLocal(extra ...map[string]any) map[string]any {
	allow := []any{
		map[string]any{"host": "allowed.test", "port": w.webPort, "networks": []string{"127.0.0.1/32"}},
		map[string]any{"host": "allowed.test", "port": w.tlsPort, "networks": []string{"127.0.0.1/32"}},
		map[string]any{"host": "private.test", "port": w.webPort},
		map[string]any{"host": "denied.test", "port": 1}, // another port only
	}
	for _, e := range extra {
		allow = append(allow, e)
	}
	return map[string]any{"allow_forward": true, "egress_allow": allow}
}

func newWorld(t *testing.T) *world {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	w := &world{pols: &testPolicies{}, rec: &memRecorder{}}
	w.web = httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if n := r.URL.Query().Get("bytes"); n != "" {
			var k int
			fmt.Sscan(n, &k)
			rw.Write(make([]byte, k))
			return
		}
		fmt.Fprintf(rw, "plain %s %s", r.Host, r.URL.Path)
	}))
	t.Cleanup(w.web.Close)
	cert, pool := selfSigned(t, "allowed.test", "other.test")
	w.pool = pool
	w.tlsWeb = httptest.NewUnstartedServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(rw, "tls %s %s", r.TLS.ServerName, r.URL.Path)
	}))
	w.tlsWeb.TLS = &tls.Config{Certificates: []tls.Certificate{cert}}
	w.tlsWeb.StartTLS()
	t.Cleanup(w.tlsWeb.Close)
	w.webPort, w.tlsPort = portOf(w.web), portOf(w.tlsWeb)
	lo := netip.MustParseAddr("127.0.0.1")
	w.resolver = &countingResolver{Hosts: Hosts{"allowed.test": {lo}, "private.test": {lo}, "other.test": {lo}, "denied.test": {lo}}}
	w.pols.set(t, w.allowLocal())

	// The guest: its egress service on a unix socket, its proxies on
	// loopback ports.
	guest := guestegress.New(guestegress.Options{Timeout: 5 * time.Second})
	sock := filepath.Join(t.TempDir(), "agent.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle(agentv1connect.NewEgressServiceHandler(guest, protocol.HandlerOptions()...))
	srv := protocol.NewHTTPServer(mux)
	go srv.Serve(l)
	for _, p := range []struct {
		addr  *string
		serve func(context.Context, net.Listener) error
	}{{&w.httpAddr, guest.ServeHTTPProxy}, {&w.socks, guest.ServeSOCKS5}} {
		pl, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		*p.addr = pl.Addr().String()
		go p.serve(ctx, pl)
	}
	hc, tr := protocol.NewHTTPClient(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	})
	link := fakeLink{agentv1connect.NewEgressServiceClient(hc, protocol.BaseURL, protocol.ClientOptions()...)}

	w.proxy = New(Config{Policies: w.pols, Audit: w.rec, Resolver: w.resolver})
	served := make(chan error, 1)
	go func() {
		served <- w.proxy.Serve(ctx, link, VM{Name: "demo", Session: "ses_1", Policy: func() string { return "test" }})
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-served:
			if err != nil {
				t.Errorf("Serve: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Error("Serve did not return after its context ended")
		}
		srv.Close()
		tr.CloseIdleConnections()
	})
	return w
}

// client is an http.Client using the guest's HTTP proxy, trusting the
// test certificate, with serverName (if set) as the TLS server name.
func (w *world) client(serverName string) *http.Client {
	u, _ := url.Parse("http://" + w.httpAddr)
	return &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{
		Proxy: http.ProxyURL(u), DisableKeepAlives: true,
		TLSClientConfig: &tls.Config{RootCAs: w.pool, ServerName: serverName},
	}}
}

func get(c *http.Client, u string) (int, string, error) {
	resp, err := c.Get(u)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

func TestAllowedConnections(t *testing.T) {
	w := newWorld(t)
	code, body, err := get(w.client(""), fmt.Sprintf("http://allowed.test:%d/a", w.webPort))
	if err != nil || code != 200 || body != fmt.Sprintf("plain allowed.test:%d /a", w.webPort) {
		t.Fatalf("plain http: %d %q %v", code, body, err)
	}
	// The tunnel ends when the client lets its connection go: it sends its
	// close_notify and closes, and the idle server closes in turn. (A
	// "Connection: close" exchange races the server's close against the
	// client's close_notify, and the server may reset the connection.)
	tc := w.client("")
	tc.Transport.(*http.Transport).DisableKeepAlives = false
	code, body, err = get(tc, fmt.Sprintf("https://allowed.test:%d/b", w.tlsPort))
	if err != nil || code != 200 || body != "tls allowed.test /b" {
		t.Fatalf("https through CONNECT: %d %q %v", code, body, err)
	}
	tc.CloseIdleConnections()
	recs := w.rec.waitRecords(t, 2)
	byProto := map[string]audit.Egress{}
	for _, r := range recs {
		byProto[r.Protocol] = r
	}
	h, c := byProto["http"], byProto["http-connect"]
	if h.Outcome != outcomeAllowed || h.Host != "allowed.test" || h.Port != uint32(w.webPort) || h.IP != "127.0.0.1" ||
		len(h.Decisions) != 2 || h.Rule != "carrel.net.egress_allow" || h.BytesUp == 0 || h.BytesDown == 0 || h.DurationNs <= 0 || h.Error != "" {
		t.Errorf("plain http record %+v", h)
	}
	// The tunnel may still end in a reset, recorded as such: the server's
	// close_notify, answering the client's, can reach a client socket
	// that is closed already, whose kernel resets it (seen under load).
	if c.Outcome != outcomeAllowed || c.SNI != "allowed.test" || c.BytesUp < 200 || c.BytesDown < 200 ||
		c.Error != "" && !strings.HasSuffix(c.Error, "connection reset by peer") {
		t.Errorf("CONNECT record %+v", c)
	}
	if h.PID == 0 {
		t.Errorf("no pid in %+v", h)
	}
}

// TestRefusals: each refusal fails fast with the reason, and is recorded.
func TestRefusals(t *testing.T) {
	w := newWorld(t)
	for _, c := range []struct {
		name, url, sni string
		want           string // in the error or the body
		rule           string
		resolved       bool
	}{
		{"denied name", "https://denied.test:443/", "", "Forbidden", "carrel.net.default_deny", false},
		{"IP literal", fmt.Sprintf("http://127.0.0.1:%d/", w.webPort), "", "an IP address, and no entry", "carrel.net.ip_literal", false},
		{"private address", fmt.Sprintf("http://private.test:%d/", w.webPort), "", "127.0.0.1 is loopback", "carrel.net.address_refused", true},
		{"port", "http://allowed.test:1/", "", "not in settings.net.egress_allow", "carrel.net.default_deny", false},
		{"sni mismatch", fmt.Sprintf("https://allowed.test:%d/", w.tlsPort), "other.test", "tls: access denied", "carrel.net.egress_allow", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			before := len(w.rec.egress(t))
			lookups := w.resolver.lookups.Load()
			start := time.Now()
			code, body, err := get(w.client(c.sni), c.url)
			msg := fmt.Sprintf("%d %s %v", code, body, err)
			if !strings.Contains(msg, c.want) || code == 200 {
				t.Errorf("%s: %s; want %q", c.url, msg, c.want)
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("refused after %v", d)
			}
			recs := w.rec.waitRecords(t, before+1)
			r := recs[len(recs)-1]
			if r.Outcome != outcomeDenied || r.Rule != c.rule || r.Error == "" || len(r.Decisions) == 0 {
				t.Errorf("record %+v; want denied by %s", r, c.rule)
			}
			if resolved := w.resolver.lookups.Load() > lookups; resolved != c.resolved {
				t.Errorf("resolved %v, want %v", resolved, c.resolved)
			}
			if c.name == "sni mismatch" && (r.SNI != "other.test" || r.BytesUp != 0) {
				t.Errorf("sni mismatch record %+v: want sni other.test and no byte upstream", r)
			}
		})
	}
	// A denied name never reached the resolver.
	if _, ok := w.resolver.names.Load("denied.test"); ok {
		t.Error("denied.test was looked up")
	}
}

func TestUnresolvableAndUnreachable(t *testing.T) {
	w := newWorld(t)
	w.pols.set(t, w.allowLocal(map[string]any{"host": "nowhere.test", "port": 80},
		map[string]any{"host": "allowed.test", "port": 1, "networks": []string{"127.0.0.1/32"}}))
	code, body, err := get(w.client(""), "http://nowhere.test/")
	if err != nil || code != 502 || !strings.Contains(body, "resolve nowhere.test") {
		t.Errorf("unresolvable: %d %q %v", code, body, err)
	}
	code, body, err = get(w.client(""), "http://allowed.test:1/")
	if err != nil || code != 502 || !strings.Contains(body, "connection refused") {
		t.Errorf("nothing listening: %d %q %v", code, body, err)
	}
	for _, r := range w.rec.waitRecords(t, 2) {
		if r.Outcome != outcomeFailed || r.Error == "" {
			t.Errorf("record %+v", r)
		}
	}
}

// TestPolicyChangeTakesEffect: the next connection is decided by the
// policy in force then.
func TestPolicyChangeTakesEffect(t *testing.T) {
	w := newWorld(t)
	u := fmt.Sprintf("http://allowed.test:%d/", w.webPort)
	if code, _, err := get(w.client(""), u); code != 200 {
		t.Fatalf("before: %d %v", code, err)
	}
	w.pols.set(t, map[string]any{"allow_forward": true, "egress_allow": []any{}})
	if code, body, _ := get(w.client(""), u); code != 403 {
		t.Fatalf("after the policy dropped allowed.test: %d %q", code, body)
	}
}

// socksOpen opens a SOCKS5 tunnel through the guest's proxy.
func socksOpen(t *testing.T, proxy, host string, port int) (net.Conn, byte) {
	t.Helper()
	c, err := net.Dial("tcp", proxy)
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(20 * time.Second))
	c.Write([]byte{5, 1, 0})
	var m [2]byte
	io.ReadFull(c, m[:])
	c.Write(append(append([]byte{5, 1, 0, 3, byte(len(host))}, host...), byte(port>>8), byte(port)))
	var rep [10]byte
	if _, err := io.ReadFull(c, rep[:]); err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Time{})
	return c, rep[1]
}

func TestMaxConnections(t *testing.T) {
	w := newWorld(t)
	lim := w.allowLocal()
	lim["limits"] = map[string]any{"max_connections": 1}
	w.pols.set(t, lim)
	first, code := socksOpen(t, w.socks, "allowed.test", w.webPort)
	if code != 0 {
		t.Fatalf("first connection: reply %d", code)
	}
	second, code := socksOpen(t, w.socks, "allowed.test", w.webPort)
	second.Close()
	if code != 2 {
		t.Fatalf("second connection with max_connections 1: reply %d, want 2 (not allowed)", code)
	}
	recs := w.rec.waitRecords(t, 1)
	if !strings.Contains(recs[0].Error, "max_connections is 1") || recs[0].Outcome != outcomeDenied {
		t.Errorf("record %+v", recs[0])
	}
	// Once the first ends, a new one may open.
	first.Close()
	w.rec.waitRecords(t, 2)
	third, code := socksOpen(t, w.socks, "allowed.test", w.webPort)
	third.Close()
	if code != 0 {
		t.Errorf("after the first closed: reply %d", code)
	}
}

func TestBandwidthLimit(t *testing.T) {
	w := newWorld(t)
	lim := w.allowLocal()
	const rate = 512 << 10
	lim["limits"] = map[string]any{"bandwidth_bytes_per_second": rate}
	w.pols.set(t, lim)
	const size = 1 << 20
	start := time.Now()
	code, body, err := get(w.client(""), fmt.Sprintf("http://allowed.test:%d/?bytes=%d", w.webPort, size))
	took := time.Since(start)
	if err != nil || code != 200 || len(body) != size {
		t.Fatalf("download: %d, %d bytes, %v", code, len(body), err)
	}
	// The first quarter second's worth comes at once.
	if min := time.Duration(float64(size-rate/4) / rate * float64(time.Second)); took < min*9/10 {
		t.Errorf("1 MiB at %d bytes/s took %v, want at least %v", rate, took, min)
	}
	t.Logf("1 MiB at 512 KiB/s: %v", took)
}

// TestHostileGuest: a guest that sends oversized or misplaced messages
// loses the connection, and what it claims is cleaned for the record.
func TestHostileGuest(t *testing.T) {
	w := newWorld(t)
	c := &conn{p: w.proxy, v: &vmState{up: newBucket(), down: newBucket()}, req: nil, rec: audit.Egress{Host: "allowed.test", IP: "127.0.0.1"}}
	for _, msgs := range [][]any{
		{make([]byte, maxChunk+1)},
		{"close", "close"},
		{"close", []byte("x")},
		// A request, then the end of the call without a close.
		{[]byte("GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n")},
	} {
		up, far := net.Pipe()
		go io.Copy(io.Discard, far)
		s := &scriptStream{msgs: msgs}
		c.req = &agentv1.EgressDialRequest{Id: 1, Host: "allowed.test", Port: 80, Kind: agentv1.EgressKind_EGRESS_KIND_HTTP}
		err := c.copyUp(context.Background(), s, up, &toGuest{s: s})
		var ge *guestError
		if !errors.As(err, &ge) {
			t.Errorf("%v: %v, want a guestError", msgs, err)
		}
		up.Close()
		far.Close()
	}
	// A guest that calls its tunnel plain http is still held to the
	// server name of a ClientHello it sends.
	up, far := net.Pipe()
	got := make(chan int, 1)
	go func() { b, _ := io.ReadAll(far); got <- len(b) }()
	c.req = &agentv1.EgressDialRequest{Id: 2, Host: "allowed.test", Port: 80, Kind: agentv1.EgressKind_EGRESS_KIND_HTTP}
	hello := realHello(t, &tls.Config{ServerName: "other.test"})
	s := &scriptStream{msgs: []any{hello[:100], hello[100:], "close"}}
	err := c.copyUp(context.Background(), s, up, &toGuest{s: s})
	up.Close()
	var r *refusal
	if !errors.As(err, &r) || !strings.Contains(r.msg, `"other.test" does not match`) || <-got != 0 || s.sent != 2 {
		t.Errorf("a ClientHello for other.test in a plain http tunnel: %v; %d messages to the guest", err, s.sent)
	}
	if got := protocol.CleanText("a\x00b\x1b[31m\xffc", 255); got != "ab[31mc" {
		t.Errorf("printable: %q", got)
	}
}

func TestHosts(t *testing.T) {
	h, err := ParseHosts(strings.NewReader("# test names\n127.0.0.1 allowed.test Other.Test.\n::1 allowed.test # v6 too\n\n10.0.0.1\tprivate.test\n"))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if a, err := h.LookupNetIP(ctx, "ip", "ALLOWED.test."); err != nil || len(a) != 2 || a[0].String() != "127.0.0.1" || a[1].String() != "::1" {
		t.Errorf("allowed.test: %v %v", a, err)
	}
	if a, err := h.LookupNetIP(ctx, "ip6", "allowed.test"); err != nil || len(a) != 1 {
		t.Errorf("allowed.test ip6: %v %v", a, err)
	}
	if a, err := h.LookupNetIP(ctx, "ip", "other.test"); err != nil || len(a) != 1 {
		t.Errorf("other.test: %v %v", a, err)
	}
	var dnsErr *net.DNSError
	if _, err := h.LookupNetIP(ctx, "ip", "example.com"); !errors.As(err, &dnsErr) || !dnsErr.IsNotFound {
		t.Errorf("a name not in the file: %v", err)
	}
	for _, bad := range []string{"not-an-ip host\n", "127.0.0.1\n", "fe80::1%eth0 x\n"} {
		if _, err := ParseHosts(strings.NewReader(bad)); err == nil {
			t.Errorf("ParseHosts(%q) accepted", bad)
		}
	}
	if _, err := ParseHosts(strings.NewReader(strings.Repeat("127.0.0.1 "+strings.Repeat("a", 100)+"\n", maxHostsBytes/100))); err == nil {
		t.Error("an oversized hosts file was accepted")
	}
}

func TestBucket(t *testing.T) {
	now := time.Unix(1000, 0)
	var slept time.Duration
	b := &bucket{now: func() time.Time { return now }, sleep: func(_ context.Context, d time.Duration) error { slept += d; now = now.Add(d); return nil }}
	ctx := context.Background()
	b.take(ctx, 1<<30)
	if slept != 0 {
		t.Fatalf("an unlimited bucket slept %v", slept)
	}
	b.setRate(1000, 100) // burst 250
	b.take(ctx, 250)
	if slept != 0 {
		t.Fatalf("the burst slept %v", slept)
	}
	b.take(ctx, 500)
	if slept != 500*time.Millisecond {
		t.Fatalf("500 over the burst slept %v, want 500ms", slept)
	}
	now = now.Add(10 * time.Second) // idle: refills to the burst, no more
	slept = 0
	b.take(ctx, 1250)
	if slept != time.Second {
		t.Fatalf("1250 after idling slept %v, want 1s", slept)
	}
	b.setRate(0, 0)
	slept = 0
	b.take(ctx, 1<<30)
	if slept != 0 {
		t.Fatalf("a bucket set back to unlimited slept %v", slept)
	}
}

// scriptStream plays a guest's messages: []byte is data, "close" a close;
// then the end of the call.
type scriptStream struct {
	msgs []any
	sent int
}

func (s *scriptStream) Receive() (*agentv1.EgressData, error) {
	if len(s.msgs) == 0 {
		return nil, io.EOF
	}
	m := s.msgs[0]
	s.msgs = s.msgs[1:]
	if b, ok := m.([]byte); ok {
		return &agentv1.EgressData{Msg: &agentv1.EgressData_Data{Data: b}}, nil
	}
	return &agentv1.EgressData{Msg: &agentv1.EgressData_Close{Close: &agentv1.EgressClose{}}}, nil
}
func (s *scriptStream) Send(*agentv1.EgressData) error { s.sent++; return nil }
func (s *scriptStream) CloseRequest() error            { return nil }
func (s *scriptStream) CloseResponse() error           { return nil }

// fakeGuest is a hostile guest's EgressService: it sends the requests it
// is given, as fast as it can, and keeps each verdict it gets.
type fakeGuest struct {
	reqs []*agentv1.EgressDialRequest

	mu       sync.Mutex
	verdicts map[uint64]*agentv1.EgressVerdict
}

func (g *fakeGuest) Requests(ctx context.Context, _ *connect.Request[agentv1.EgressRequestsRequest], s *connect.ServerStream[agentv1.EgressDialRequest]) error {
	for _, r := range g.reqs {
		if err := s.Send(r); err != nil {
			return err
		}
	}
	<-ctx.Done()
	return nil
}

func (g *fakeGuest) Connect(ctx context.Context, s *connect.BidiStream[agentv1.EgressData, agentv1.EgressData]) error {
	m, err := s.Receive()
	if err != nil {
		return err
	}
	v := m.GetVerdict()
	g.mu.Lock()
	g.verdicts[v.Id] = v
	g.mu.Unlock()
	return nil // and nothing more: an allowed connection ends at once
}

func (g *fakeGuest) count() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.verdicts)
}

// serveFakeGuest serves g on a unix socket and returns a link to it.
func serveFakeGuest(t *testing.T, g *fakeGuest) fakeLink {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "guest.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle(agentv1connect.NewEgressServiceHandler(g, protocol.HandlerOptions()...))
	srv := protocol.NewHTTPServer(mux)
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	hc, tr := protocol.NewHTTPClient(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	})
	t.Cleanup(tr.CloseIdleConnections)
	return fakeLink{agentv1connect.NewEgressServiceClient(hc, protocol.BaseURL, protocol.ClientOptions()...)}
}

// TestHostileRequests: what a guest asks for is checked before anything
// is resolved or dialled, each refusal is recorded with the guest's words
// cleaned, and a flood of requests is paced.
func TestHostileRequests(t *testing.T) {
	web := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer web.Close()
	port := uint32(portOf(web))
	kind := agentv1.EgressKind_EGRESS_KIND_SOCKS5
	g := &fakeGuest{verdicts: map[uint64]*agentv1.EgressVerdict{}, reqs: []*agentv1.EgressDialRequest{
		{Id: 1, Host: "a\x00b.test", Port: port, Kind: kind},
		{Id: 2, Host: strings.Repeat("a", 300), Port: port, Kind: kind},
		{Id: 3, Host: "allowed.test", Port: 0, Kind: kind},
		{Id: 4, Host: "allowed.test", Port: 70000, Kind: kind},
		{Id: 5, Host: "allowed.test", Port: port, Kind: 99},
		{Id: 6, Host: "allowed.test\x1b[2J", Port: port, Kind: kind},
		{Id: 7, Host: "", Port: port, Kind: kind},
		{Id: 8, Host: "ALLOWED.Test.", Port: port, Kind: kind, Pid: -5}, // normalised: allowed
	}}
	const flood = 60
	for i := range flood {
		g.reqs = append(g.reqs, &agentv1.EgressDialRequest{Id: uint64(100 + i), Host: "denied.test", Port: 443, Kind: kind})
	}
	pols, rec := &testPolicies{}, &memRecorder{}
	pols.set(t, map[string]any{"allow_forward": true, "egress_allow": []any{
		map[string]any{"host": "allowed.test", "port": port, "networks": []string{"127.0.0.1/32"}},
	}})
	resolver := &countingResolver{Hosts: Hosts{"allowed.test": {netip.MustParseAddr("127.0.0.1")}}}
	p := New(Config{Policies: pols, Audit: rec, Resolver: resolver, AttemptRate: 40})
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	start := time.Now()
	go func() {
		served <- p.Serve(ctx, serveFakeGuest(t, g), VM{Name: "demo", Session: "ses_1", Policy: func() string { return "test" }})
	}()
	deadline := time.Now().Add(20 * time.Second)
	for g.count() < len(g.reqs) && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	took := time.Since(start)
	cancel()
	if err := <-served; err != nil {
		t.Fatal(err)
	}
	if n := g.count(); n != len(g.reqs) {
		t.Fatalf("%d verdicts for %d requests", n, len(g.reqs))
	}
	// 68 requests at 40 a second, the first 40 at once.
	if want := time.Duration(float64(len(g.reqs)-40) / 40 * float64(time.Second)); took < want*8/10 {
		t.Errorf("%d requests answered in %v; at 40 a second that takes %v", len(g.reqs), took, want)
	}
	for id := uint64(1); id <= 7; id++ {
		if v := g.verdicts[id]; v.Outcome != agentv1.EgressOutcome_EGRESS_OUTCOME_DENIED || v.Reason == "" {
			t.Errorf("request %d: %v", id, v)
		}
	}
	if v := g.verdicts[8]; v.Outcome != agentv1.EgressOutcome_EGRESS_OUTCOME_ALLOWED {
		t.Errorf("request 8 (ALLOWED.Test.): %v", v)
	}
	if n := resolver.lookups.Load(); n != 1 {
		t.Errorf("%d lookups; only the allowed request should resolve", n)
	}
	recs := rec.egress(t)
	if len(recs) != len(g.reqs) {
		t.Fatalf("%d records for %d requests", len(recs), len(g.reqs))
	}
	for _, r := range recs {
		if strings.ContainsAny(r.Host, "\x00\x1b") || len(r.Host) > 255 || r.PID < 0 {
			t.Errorf("record keeps what the guest sent raw: %+v", r)
		}
		if r.ID == 8 && (r.Host != "allowed.test" || r.Outcome != outcomeAllowed) {
			t.Errorf("record of request 8: %+v", r)
		}
	}
}
