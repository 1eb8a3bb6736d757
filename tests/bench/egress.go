package main

// Egress (supervisor/egress, guest-agent/egress): a download from a local
// HTTP server, through the guest's HTTP proxy, the agent link and
// carreld's egress proxy, into /dev/null in the guest, against the same
// download made directly on the host from the same server; alternating
// round by round. Throughput through the tunnel is timed on the host,
// around the whole `carrel exec` of the probe (tests/egressprobe): a TCG
// guest's clock can jump under load, and the exec's own cost is small
// beside a long download. Time to first byte is the probe's own
// measurement, inside the guest, of one request. For scale, each
// round also uploads the same number of bytes into the guest with carrel's
// file service: the same link, the same direction, no egress in the way.
// Connection setup is the time to the response's first byte of a tiny
// request, each way.

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/tests/harness"
)

const (
	egressName      = "bench.test" // in the hosts file carreld gets
	egressVM        = "egress"
	egressSetupRuns = 20
	egressTarget    = 0.5 // of direct throughput
)

// egressHosts writes the hosts file that carreld resolves egressName with.
func egressHosts(dir string) (string, error) {
	p := filepath.Join(dir, "egress-hosts")
	return p, os.WriteFile(p, []byte("127.0.0.1 "+egressName+"\n"), 0o644)
}

// egressServer serves /blob?n=BYTES (random bytes, repeated from a 1 MiB
// block) and /small on the host's loopback.
func egressServer() (port int, stop func(), err error) {
	block := make([]byte, 1<<20)
	rand.NewChaCha8([32]byte{'e', 'g', 'r', 'e', 's', 's'}).Read(block)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/small" {
			io.WriteString(w, "ok")
			return
		}
		n, _ := strconv.ParseInt(r.URL.Query().Get("n"), 10, 64)
		w.Header().Set("Content-Length", strconv.FormatInt(n, 10))
		for n > 0 {
			k := min(n, int64(len(block)))
			if _, err := w.Write(block[:k]); err != nil {
				return
			}
			n -= k
		}
	})
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, nil, err
	}
	srv := &http.Server{Handler: h}
	go srv.Serve(l)
	return l.Addr().(*net.TCPAddr).Port, func() { srv.Close() }, nil
}

// probeResult is what egressprobe get prints.
type probeResult struct {
	bytes       int64
	ttfb, total time.Duration
}

func parseProbe(out string) (probeResult, error) {
	var r probeResult
	status := ""
	for _, line := range strings.Split(out, "\n") {
		k, v, _ := strings.Cut(line, " ")
		n, _ := strconv.ParseInt(v, 10, 64)
		switch k {
		case "status":
			status = v
		case "bytes":
			r.bytes = n
		case "ttfb":
			r.ttfb = time.Duration(n)
		case "total":
			r.total = time.Duration(n)
		case "error:":
			return r, fmt.Errorf("probe: %s", line)
		}
	}
	if status != "200" || r.total == 0 {
		return r, fmt.Errorf("probe said %q", out)
	}
	return r, nil
}

// directGet is the baseline: the same request from the host, on a fresh
// connection.
func directGet(url string) (probeResult, error) {
	c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true, DisableCompression: true, Proxy: nil}}
	start := time.Now()
	resp, err := c.Get(url)
	if err != nil {
		return probeResult{}, err
	}
	defer resp.Body.Close()
	ttfb := time.Since(start)
	n, err := io.CopyBuffer(io.Discard, resp.Body, make([]byte, 256<<10))
	return probeResult{bytes: n, ttfb: ttfb, total: time.Since(start)}, err
}

func benchEgress(t *tb, d *harness.Daemon, size int64, rounds int) {
	port, stop, err := egressServer()
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	d.ApplyPolicy("bench-egress", func(s map[string]any) {
		s["net"].(map[string]any)["egress_allow"] = []any{
			map[string]any{"host": egressName, "port": port, "networks": []string{"127.0.0.1/32"}},
		}
	})
	d.Must("vm", "create", egressVM, "--memory", "1G", "--cpus", "1", "--policy", "bench-egress")
	defer d.Must("vm", "rm", "--force", egressVM)
	dir, err := os.MkdirTemp("", "egress-bench-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	probe := filepath.Join(dir, "egressprobe")
	build := exec.Command("go", "build", "-trimpath", "-o", probe, "./tests/egressprobe")
	build.Dir = harness.RepoRoot()
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the egress probe: %v\n%s", err, out)
	}
	d.Must("cp", probe, egressVM+":/workspace/egressprobe")
	// tunnel's total is the host's time for the whole exec.
	tunnel := func(path string) (probeResult, error) {
		start := time.Now()
		r := d.CarrelTimeout(30*time.Minute, "exec", egressVM, "--", "/workspace/egressprobe", "get", "-out", "/dev/null", fmt.Sprintf("http://%s:%d%s", egressName, port, path))
		took := time.Since(start)
		if r.Code != 0 {
			return probeResult{}, fmt.Errorf("probe: exit %d: %s%s", r.Code, r.Stdout, r.Stderr)
		}
		pr, err := parseProbe(r.Stdout)
		pr.total = took
		return pr, err
	}
	direct := func(path string) (probeResult, error) {
		return directGet(fmt.Sprintf("http://127.0.0.1:%d%s", port, path))
	}
	// Warm up both paths (the agent's proxy, the host's page cache).
	if _, err := tunnel("/small"); err != nil {
		t.Fatal(err)
	}
	if _, err := direct("/small"); err != nil {
		t.Fatal(err)
	}

	blob := fmt.Sprintf("/blob?n=%d", size)
	c := client.New(d.Socket)
	upload := bytes.Repeat([]byte{0x5a}, int(min(size, 1<<20)))
	fmt.Printf("\negress: %d MiB download over plain http, %d rounds each, alternating; tunnel = guest proxy + agent link + carreld's egress proxy, into /dev/null in the guest (timed on the host, carrel exec included)\n",
		size>>20, rounds)
	var tun, dirs, link []float64
	for i := 0; i < rounds; i++ {
		tr, err := tunnel(blob)
		if err != nil || tr.bytes != size {
			t.Fatalf("tunnel round %d: %d bytes, %v", i+1, tr.bytes, err)
		}
		dr, err := direct(blob)
		if err != nil || dr.bytes != size {
			t.Fatalf("direct round %d: %d bytes, %v", i+1, dr.bytes, err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
		start := time.Now()
		_, err = c.Upload(ctx, egressVM, "/tmp/egress-link", &repeatReader{block: upload, left: size}, 0o644)
		lt := time.Since(start)
		cancel()
		if err != nil {
			t.Fatalf("link round %d: %v", i+1, err)
		}
		d.Must("exec", egressVM, "--", "rm", "-f", "/tmp/egress-link")
		tun, dirs, link = append(tun, mibps(size, tr.total)), append(dirs, mibps(size, dr.total)), append(link, mibps(size, lt))
		fmt.Printf("  round %d: tunnel %.1f MiB/s (first byte %s), direct %.1f MiB/s (first byte %s), carrel upload on the same link %.1f MiB/s\n",
			i+1, tun[i], fmtDur(tr.ttfb), dirs[i], fmtDur(dr.ttfb), link[i])
	}
	mt, md, ml := medianFloat(tun), medianFloat(dirs), medianFloat(link)
	ratio := mt / md
	fmt.Printf("egress throughput median: tunnel %.1f MiB/s, direct %.1f MiB/s, ratio tunnel/direct %.3f (target >= %.2f: %s); tunnel/link upload %.3f\n",
		mt, md, ratio, egressTarget, verdict(ratio >= egressTarget), mt/ml)

	var ts, ds []time.Duration
	for i := 0; i < egressSetupRuns; i++ {
		tr, err := tunnel("/small")
		if err != nil {
			t.Fatal(err)
		}
		dr, err := direct("/small")
		if err != nil {
			t.Fatal(err)
		}
		ts, ds = append(ts, tr.ttfb), append(ds, dr.ttfb)
	}
	fmt.Printf("egress connection setup (new connection to the first response byte, tiny GET), %d each, alternating: tunnel p50 %s p90 %s, direct p50 %s p90 %s\n",
		egressSetupRuns, fmtDur(percentile(ts, 50)), fmtDur(percentile(ts, 90)), fmtDur(percentile(ds, 50)), fmtDur(percentile(ds, 90)))
}

// repeatReader yields left bytes of block, repeated.
type repeatReader struct {
	block []byte
	left  int64
	off   int
}

func (r *repeatReader) Read(p []byte) (int, error) {
	if r.left == 0 {
		return 0, io.EOF
	}
	n := copy(p, r.block[r.off:])
	n = int(min(int64(n), r.left))
	r.off = (r.off + n) % len(r.block)
	r.left -= int64(n)
	return n, nil
}
