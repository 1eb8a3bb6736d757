package tests

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/tests/harness"
)

// egressServers are the test's stand-in for the internet: an HTTP server
// and an HTTPS server (a self-signed certificate for allowed.test) on the
// host's loopback.
type egressServers struct {
	httpPort, httpsPort int
	caPEM               []byte
}

func startEgressServers(t *testing.T) egressServers {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "allowed.test"}, DNSNames: []string{"allowed.test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		scheme := "http"
		if r.TLS != nil {
			scheme = "https " + r.TLS.ServerName
		}
		fmt.Fprintf(w, "hello over %s to %s\n", scheme, r.Host)
	})
	serve := func(l net.Listener) int {
		srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
		go srv.Serve(l)
		t.Cleanup(func() { srv.Close() })
		return l.Addr().(*net.TCPAddr).Port
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tl = tls.NewListener(tl, &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}})
	return egressServers{httpPort: serve(l), httpsPort: serve(tl), caPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// buildProbe builds tests/egressprobe, static, into dir.
func buildProbe(t harness.TB, dir string) string {
	t.Helper()
	out := filepath.Join(dir, "egressprobe")
	cmd := exec.Command("go", "build", "-trimpath", "-o", out, "./tests/egressprobe")
	cmd.Dir = harness.RepoRoot()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build the egress probe: %v\n%s", err, b)
	}
	return out
}

// egressRecord is the part of a net.egress record the test checks.
type egressRecord struct {
	Host      string   `json:"host"`
	Port      int      `json:"port"`
	Protocol  string   `json:"protocol"`
	Outcome   string   `json:"outcome"`
	Rule      string   `json:"rule"`
	Decisions []string `json:"decisions"`
	IP        string   `json:"ip"`
	SNI       string   `json:"sni"`
	HTTPHost  string   `json:"http_host"`
	PID       int      `json:"pid"`
	BytesUp   int64    `json:"bytes_up"`
	BytesDown int64    `json:"bytes_down"`
	Error     string   `json:"error"`
	session   string
}

// egressRecords are the net.egress records of vm's connections.
// scanLive scans the audit log of a running carreld, whose last frame may
// be half written as it is read: a scan that fails is run again (reset
// first) until one reads every frame whole, for up to 5 s.
func scanLive(dir string, reset func(), fn func(seq uint64, offset int64, payload []byte) error) error {
	deadline := time.Now().Add(5 * time.Second)
	for {
		reset()
		err := audit.Scan(dir, fn)
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func egressRecords(t *testing.T, d *harness.Daemon, vm string) []egressRecord {
	t.Helper()
	var out []egressRecord
	err := scanLive(filepath.Join(d.State, "audit"), func() { out = nil }, func(_ uint64, _ int64, payload []byte) error {
		r, err := audit.Decode(payload)
		if err != nil || r.Kind != audit.KindNetEgress {
			return err
		}
		if r.VM != vm {
			return nil
		}
		if r.Provenance != audit.Host {
			t.Errorf("net.egress record %+v", r)
		}
		var e egressRecord
		if err := json.Unmarshal(r.Data, &e); err != nil {
			return err
		}
		e.session = r.Session
		out = append(out, e)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// lastLine is s's last non-empty line.
func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

// sessionOf is the VM's current session, from vm ls.
func sessionOf(t *testing.T, d *harness.Daemon, name string) string {
	t.Helper()
	var out struct {
		VMs []struct {
			Name    string `json:"name"`
			Session string `json:"session"`
		} `json:"vms"`
	}
	if err := json.Unmarshal([]byte(d.Must("vm", "ls", "--output", "json")), &out); err != nil {
		t.Fatal(err)
	}
	for _, v := range out.VMs {
		if v.Name == name && v.Session != "" {
			return v.Session
		}
	}
	t.Fatalf("vm ls shows no session for %s", name)
	return ""
}

// TestEgress: a VM reaches allowed names through carrel-agent's proxies
// and carreld's egress proxy, and nothing else; every connection is
// decided by the VM's current policy and recorded.
func TestEgress(t *testing.T) {
	srv := startEgressServers(t)
	work := t.TempDir()
	hosts := filepath.Join(work, "hosts")
	if err := os.WriteFile(hosts, []byte("# the test's names, all on the host's loopback\n127.0.0.1 allowed.test other.test private.test denied.test\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	probe := buildProbe(t, work)
	ca := filepath.Join(work, "ca.pem")
	if err := os.WriteFile(ca, srv.caPEM, 0o644); err != nil {
		t.Fatal(err)
	}

	d := harness.New(t, "--egress-hosts", hosts)
	d.Start()
	d.BuildImage()
	allowAll := func(s map[string]any) {
		s["exec"].(map[string]any)["allow_root"] = true
		s["net"].(map[string]any)["egress_allow"] = []any{
			// The test's names resolve to 127.0.0.1: named here, or refused.
			map[string]any{"host": "allowed.test", "port": srv.httpPort, "networks": []string{"127.0.0.1/32"}},
			map[string]any{"host": "allowed.test", "port": srv.httpsPort, "networks": []string{"127.0.0.1/32"}},
			map[string]any{"host": "private.test", "port": srv.httpPort},
		}
	}
	d.ApplyPolicy("egress", allowAll)
	d.Must("vm", "create", "net", "--policy", "egress", "--memory", "512M")
	d.Must("cp", probe, "net:/workspace/egressprobe")
	d.Must("cp", ca, "net:/workspace/ca.pem")
	session := sessionOf(t, d, "net")

	run := func(args ...string) harness.Result {
		t.Helper()
		return d.Carrel(append([]string{"exec", "net", "--", "/workspace/egressprobe"}, args...)...)
	}
	httpURL := fmt.Sprintf("http://allowed.test:%d/x", srv.httpPort)
	httpsURL := fmt.Sprintf("https://allowed.test:%d/y", srv.httpsPort)

	t.Run("environment", func(t *testing.T) {
		out := d.Must("exec", "net", "--", "env")
		for _, want := range []string{"HTTP_PROXY=http://127.0.0.1:3128", "HTTPS_PROXY=http://127.0.0.1:3128", "ALL_PROXY=socks5h://127.0.0.1:1080",
			"http_proxy=http://127.0.0.1:3128", "NO_PROXY=localhost,127.0.0.1"} {
			if !strings.Contains(out, want) {
				t.Errorf("env has no %s:\n%s", want, out)
			}
		}
		if out := d.Must("exec", "--env", "HTTP_PROXY=mine", "net", "--", "sh", "-c", "echo $HTTP_PROXY"); out != "mine\n" {
			t.Errorf("a caller's HTTP_PROXY: %q", out)
		}
	})

	t.Run("allowed", func(t *testing.T) {
		if r := run("get", httpURL); r.Code != 0 || !strings.Contains(r.Stdout, "status 200") || !strings.Contains(r.Stdout, fmt.Sprintf("hello over http to allowed.test:%d", srv.httpPort)) {
			t.Errorf("http: %+v", r)
		}
		if r := run("get", "-ca", "/workspace/ca.pem", httpsURL); r.Code != 0 || !strings.Contains(r.Stdout, "status 200") || !strings.Contains(r.Stdout, "hello over https allowed.test") {
			t.Errorf("https through CONNECT: %+v", r)
		}
		if r := run("socks", "allowed.test", fmt.Sprint(srv.httpPort)); r.Code != 0 || !strings.Contains(r.Stdout, "reply 0") || !strings.Contains(r.Stdout, "response HTTP/1.0 200") {
			t.Errorf("SOCKS5: %+v", r)
		}
		// busybox wget honours http_proxy too.
		if out := d.Must("exec", "net", "--", "wget", "-qO-", httpURL); !strings.Contains(out, "hello over http") {
			t.Errorf("busybox wget: %q", out)
		}
	})

	t.Run("denied", func(t *testing.T) {
		for _, c := range []struct {
			name string
			args []string
			want string
		}{
			{"denied name", []string{"get", fmt.Sprintf("http://denied.test:%d/", srv.httpPort)}, "carrel.net.default_deny"},
			{"IP literal", []string{"get", fmt.Sprintf("http://203.0.113.5:%d/", srv.httpPort)}, "carrel.net.ip_literal"},
			{"IP literal over SOCKS5", []string{"socks", "127.0.0.1", fmt.Sprint(srv.httpPort)}, "reply 2"},
			{"private address", []string{"get", fmt.Sprintf("http://private.test:%d/", srv.httpPort)}, "carrel.net.address_refused"},
			{"SNI mismatch", []string{"get", "-ca", "/workspace/ca.pem", "-sni", "other.test", httpsURL}, "tls: access denied"},
			{"port", []string{"get", "http://allowed.test:1/"}, "carrel.net.default_deny"},
			{"Host header of another name", []string{"tunnel", fmt.Sprintf("allowed.test:%d", srv.httpPort), "other.test"}, "response HTTP/1.1 403"},
		} {
			start := time.Now()
			r := run(c.args...)
			if !strings.Contains(r.Stdout, c.want) || strings.Contains(r.Stdout, "status 200") {
				t.Errorf("%s: %+v; want %q", c.name, r, c.want)
			}
			if strings.HasPrefix(c.args[0], "get") && !strings.Contains(c.want, "tls") && !strings.Contains(r.Stdout, "status 403") {
				t.Errorf("%s: %q; want status 403", c.name, r.Stdout)
			}
			t.Logf("%s: refused in %v: %s", c.name, time.Since(start).Round(time.Millisecond), lastLine(r.Stdout))
		}
	})

	t.Run("no way around the proxy", func(t *testing.T) {
		if out := d.Must("exec", "--user", "root", "net", "--", "ls", "/sys/class/net"); strings.TrimSpace(out) != "lo" {
			t.Errorf("network interfaces: %q, want lo only", out)
		}
		r := d.Carrel("exec", "--user", "root", "net", "--", "/workspace/egressprobe", "direct", "10.0.2.2:80")
		if r.Code == 0 || !strings.Contains(r.Stdout, "network is unreachable") {
			t.Errorf("root connecting directly: %+v", r)
		}
	})

	t.Run("policy change", func(t *testing.T) {
		d.ApplyPolicy("egress", func(s map[string]any) {
			allowAll(s)
			s["net"].(map[string]any)["egress_allow"] = s["net"].(map[string]any)["egress_allow"].([]any)[1:] // http dropped
		})
		if r := run("get", httpURL); !strings.Contains(r.Stdout, "status 403") || !strings.Contains(r.Stdout, "carrel.net.default_deny") {
			t.Errorf("http after the policy dropped it: %+v", r)
		}
		if r := run("get", "-ca", "/workspace/ca.pem", httpsURL); !strings.Contains(r.Stdout, "status 200") {
			t.Errorf("https, still allowed: %+v", r)
		}
		if now := sessionOf(t, d, "net"); now != session {
			t.Errorf("the VM's session changed from %s to %s: it restarted", session, now)
		}
	})

	t.Run("audit", func(t *testing.T) {
		recs := egressRecords(t, d, "net")
		find := func(what string, f func(egressRecord) bool) egressRecord {
			t.Helper()
			for _, r := range recs {
				if f(r) {
					return r
				}
			}
			t.Errorf("no net.egress record of %s among %d:\n%+v", what, len(recs), recs)
			return egressRecord{}
		}
		h := find("the allowed http GET", func(r egressRecord) bool {
			return r.Host == "allowed.test" && r.Protocol == "http" && r.Outcome == "allowed"
		})
		if h.IP != "127.0.0.1" || h.BytesUp == 0 || h.BytesDown == 0 || len(h.Decisions) != 2 || h.PID == 0 || h.session != session {
			t.Errorf("allowed http record %+v (session %s)", h, session)
		}
		s := find("the allowed https tunnel", func(r egressRecord) bool {
			return r.Protocol == "http-connect" && r.Outcome == "allowed" && r.SNI == "allowed.test"
		})
		if s.BytesDown == 0 {
			t.Errorf("https record %+v", s)
		}
		find("the SOCKS5 connection", func(r egressRecord) bool { return r.Protocol == "socks5" && r.Outcome == "allowed" })
		find("the denied name", func(r egressRecord) bool {
			return r.Host == "denied.test" && r.Outcome == "denied" && r.Rule == "carrel.net.default_deny"
		})
		find("the IP literal", func(r egressRecord) bool { return r.Host == "203.0.113.5" && r.Rule == "carrel.net.ip_literal" })
		find("the private address", func(r egressRecord) bool {
			return r.Host == "private.test" && r.Rule == "carrel.net.address_refused" && r.Outcome == "denied"
		})
		find("the SNI mismatch", func(r egressRecord) bool {
			return r.SNI == "other.test" && r.Outcome == "denied" && strings.Contains(r.Error, "does not match") && r.BytesUp == 0
		})
		find("the port", func(r egressRecord) bool { return r.Port == 1 && r.Rule == "carrel.net.default_deny" })
		find("the Host header mismatch", func(r egressRecord) bool {
			return r.HTTPHost == "other.test" && r.Outcome == "denied" && strings.Contains(r.Error, "does not match") && r.BytesUp == 0
		})
		for _, r := range recs {
			if r.Outcome == "denied" && r.Error == "" {
				t.Errorf("a denied record without its reason: %+v", r)
			}
		}
	})
}
