package tests

import (
	"archive/zip"
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/tests/harness"
)

// TestAgentImage boots the built-in agent image, a Debian userland on a
// verified root, and works in it as an agent would: python3, git, node and
// a C compile; pip installing a package from an index on the host, reached
// only through the egress proxy and only where the policy allows that
// index; and what pip installed is still there after a stop and start.
func TestAgentImage(t *testing.T) {
	index := startPackageIndex(t)
	work := t.TempDir()
	hosts := filepath.Join(work, "hosts")
	if err := os.WriteFile(hosts, []byte("127.0.0.1 pypi.carrel.test\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	d := harness.New(t, "--egress-hosts", hosts)
	d.Start()
	start := time.Now()
	r := d.CarrelTimeout(30*time.Minute, "image", "build", "agent")
	if r.Code != 0 {
		t.Fatalf("image build agent: %+v", r)
	}
	t.Logf("image build agent took %s (%s)", time.Since(start).Round(time.Second), strings.TrimSpace(r.Stderr))
	d.Must("vm", "create", "ag", "--image", "agent", "--memory", "1G")

	out := d.Must("exec", "ag", "--", "sh", "-c", "python3 --version; git --version; node --version; gcc --version | head -1")
	for _, want := range []string{"Python 3.", "git version ", "v", "gcc (Debian"} {
		if !strings.Contains(out, want) {
			t.Errorf("no %q in:\n%s", want, out)
		}
	}
	if out := d.Must("exec", "ag", "--", "sh", "-c",
		`printf '#include <stdio.h>\nint main(void){puts("compiled");return 0;}\n' > hello.c && gcc -O2 -o hello hello.c && ./hello`); out != "compiled\n" {
		t.Errorf("C compile: %q", out)
	}

	pip := []string{"exec", "ag", "--", "pip", "install", "--user", "--retries", "0", "--timeout", "20",
		"--index-url", index.url + "/simple/", "--trusted-host", "pypi.carrel.test", "carrelpkg"}
	// The default policy allows no egress: the install fails, and the
	// refused connection is recorded.
	r = d.Carrel(pip...)
	if r.Code == 0 || strings.Contains(r.Stdout, "Successfully installed") {
		t.Fatalf("pip install under the default policy: %+v", r)
	}
	if !hasEgress(t, d, "pypi.carrel.test", "denied", "carrel.net.default_deny") {
		t.Errorf("no denied net.egress record for pypi.carrel.test: %+v", egressRecords(t, d, "ag"))
	}

	// Every network tool of the image goes through the proxy, by its own
	// configuration where it ignores the environment (apt): each refused
	// connection is there, by name, in the audit log.
	// apt runs as root, and writes its lists: a policy that allows that.
	d.ApplyPolicy("apt", func(s map[string]any) {
		harness.AllowRoot(s)
		fs := s["fs"].(map[string]any)
		fs["read_write"] = append(fs["read_write"].([]any), "/var/lib/apt", "/var/cache/apt")
	}, "--vm", "ag")
	for _, c := range []struct {
		host string
		user string
		argv []string
	}{
		{"git.carrel.test", "agent", []string{"git", "ls-remote", "http://git.carrel.test/repo.git"}},
		{"npm.carrel.test", "agent", []string{"npm", "view", "left-pad", "--registry", "http://npm.carrel.test/", "--fetch-retries=0"}},
		{"wget.carrel.test", "agent", []string{"wget", "-q", "-O", "/dev/null", "--tries=1", "http://wget.carrel.test/"}},
		{"deb.debian.org", "root", []string{"apt-get", "-o", "Acquire::Retries=0", "update"}},
	} {
		d.Carrel(append([]string{"exec", "--user", c.user, "ag", "--"}, c.argv...)...)
		if !hasEgress(t, d, c.host, "denied", "") {
			t.Errorf("%s: no denied net.egress record for %s", c.argv[0], c.host)
		}
	}

	// A policy that allows only that index.
	d.ApplyPolicy("pypi", func(s map[string]any) {
		s["net"].(map[string]any)["egress_allow"] = []any{
			map[string]any{"host": "pypi.carrel.test", "port": index.port, "networks": []string{"127.0.0.1/32"}},
		}
	}, "--vm", "ag")
	if r := d.Carrel(pip...); r.Code != 0 || !strings.Contains(r.Stdout, "Successfully installed carrelpkg-1.0") {
		t.Fatalf("pip install through the proxy: %+v", r)
	}
	if !hasEgress(t, d, "pypi.carrel.test", "allowed", "") {
		t.Errorf("no allowed net.egress record for pypi.carrel.test")
	}
	importPkg := []string{"exec", "ag", "--", "python3", "-c", "import carrelpkg, sys; print(carrelpkg.VALUE, carrelpkg.__file__)"}
	if out := d.Must(importPkg...); !strings.HasPrefix(out, "42 /home/agent/.local/lib/python3") {
		t.Errorf("import: %q", out)
	}
	// Other hosts stay closed under the new policy.
	if r := d.Carrel("exec", "ag", "--", "curl", "-sS", "--max-time", "20", "-o", "/dev/null", "-w", "%{http_code}", "http://example.com/"); r.Stdout != "403" {
		t.Errorf("curl to another host: %+v", r)
	}

	d.Must("vm", "stop", "ag")
	d.Must("vm", "start", "ag")
	if out := d.Must(importPkg...); !strings.HasPrefix(out, "42 ") {
		t.Errorf("after stop and start: %q", out)
	}
	d.Must("vm", "reset", "ag")
	if r := d.Carrel(importPkg...); r.Code == 0 {
		t.Errorf("the package outlived vm reset: %+v", r)
	}
}

func hasEgress(t *testing.T, d *harness.Daemon, host, outcome, rule string) bool {
	t.Helper()
	for _, r := range egressRecords(t, d, "ag") {
		if r.Host == host && r.Outcome == outcome && (rule == "" || r.Rule == rule) {
			return true
		}
	}
	return false
}

// packageIndex is a PEP 503 simple index on the host's loopback, serving
// one pure-Python wheel, carrelpkg 1.0.
type packageIndex struct {
	url  string // http://pypi.carrel.test:PORT, as the guest names it
	port int
}

func startPackageIndex(t *testing.T) packageIndex {
	t.Helper()
	wheel := makeWheel(t)
	sum := sha256.Sum256(wheel)
	const name = "carrelpkg-1.0-py3-none-any.whl"
	mux := http.NewServeMux()
	mux.HandleFunc("/simple/carrelpkg/", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "<!DOCTYPE html><html><body><a href=\"/files/%s#sha256=%s\">%s</a></body></html>\n", name, hex.EncodeToString(sum[:]), name)
	})
	mux.HandleFunc("/files/"+name, func(w http.ResponseWriter, r *http.Request) { w.Write(wheel) })
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	port := l.Addr().(*net.TCPAddr).Port
	return packageIndex{url: fmt.Sprintf("http://pypi.carrel.test:%d", port), port: port}
}

// makeWheel builds carrelpkg 1.0, a wheel whose module says VALUE = 42.
func makeWheel(t *testing.T) []byte {
	t.Helper()
	files := [][2]string{
		{"carrelpkg/__init__.py", "VALUE = 42\n"},
		{"carrelpkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: carrelpkg\nVersion: 1.0\n"},
		{"carrelpkg-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: carrel-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"},
	}
	var buf bytes.Buffer
	z := zip.NewWriter(&buf)
	var record strings.Builder
	for _, f := range files {
		w, err := z.Create(f[0])
		if err != nil {
			t.Fatal(err)
		}
		w.Write([]byte(f[1]))
		sum := sha256.Sum256([]byte(f[1]))
		fmt.Fprintf(&record, "%s,sha256=%s,%d\n", f[0], base64.RawURLEncoding.EncodeToString(sum[:]), len(f[1]))
	}
	record.WriteString("carrelpkg-1.0.dist-info/RECORD,,\n")
	w, err := z.Create("carrelpkg-1.0.dist-info/RECORD")
	if err != nil {
		t.Fatal(err)
	}
	w.Write([]byte(record.String()))
	if err := z.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}
