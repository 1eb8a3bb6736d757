package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/tests/harness"
)

// benchAgents measures the agent doors against carrel's own:
//   - the e2b SDK's commands.run('true') through carreld's e2b API,
//     against the same command (/bin/bash -l -c true, as the SDK sends
//     it) through carrel's Go client, in one VM of the agent image, in
//     alternating batches. Target: the façade adds at most 10%.
//   - MCP's exec tool (the Go SDK's client on carrel mcp's stdio, one
//     session) against `carrel exec` (a CLI process per call).
func benchAgents(t *tb, runs int) {
	sdk := filepath.Join(harness.CacheDir(), "npm", "e2b-sdk", "node_modules")
	if _, err := os.Stat(filepath.Join(sdk, "e2b", "package.json")); err != nil {
		fmt.Printf("\nagent doors: left out, the e2b SDK is not installed (make e2b-sdk)\n")
		return
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	d := harness.New(t, "--driver", "qemu", "--e2b-listen", addr)
	d.Start()
	defer d.Stop()
	if r := d.CarrelTimeout(30*time.Minute, "image", "build", "agent"); r.Code != 0 {
		t.Fatalf("image build agent: %+v", r)
	}
	key := strings.TrimSpace(d.Must("key", "create", "bench", "--image", "agent"))
	base := "http://" + addr
	req, _ := http.NewRequest("POST", base+"/v2/sandboxes", strings.NewReader(`{"templateID":"agent","timeout":3600}`))
	req.Header.Set("X-Api-Key", key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var sbx struct{ SandboxID string }
	err = json.NewDecoder(resp.Body).Decode(&sbx)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusCreated {
		t.Fatalf("create a sandbox: %d %v", resp.StatusCode, err)
	}
	vm := sbx.SandboxID

	// The e2b SDK and the Go client, alternating in batches of runs/5.
	c := client.New(d.Socket)
	batch := max(runs/5, 1)
	var viaE2B, viaGo []time.Duration
	for len(viaE2B) < runs {
		ns, err := e2bRuns(sdk, base, key, vm, batch)
		if err != nil {
			t.Fatalf("e2b SDK: %v", err)
		}
		viaE2B = append(viaE2B, ns...)
		for range batch {
			start := time.Now()
			x, err := c.Run(context.Background(), client.Session{VM: vm, Start: &agentv1.ExecRequest{Argv: []string{"/bin/bash", "-l", "-c", "true"}}})
			if err != nil || x.GetCode() != 0 {
				t.Fatalf("Go client: %v (exit %v)", err, x)
			}
			viaGo = append(viaGo, time.Since(start))
		}
	}
	e, g := median(viaE2B), median(viaGo)
	ratio := float64(e) / float64(g)
	fmt.Printf("\nagent doors, one VM of the agent image (1 vCPU), /bin/bash -l -c true, %d runs each, alternating:\n", len(viaE2B))
	fmt.Printf("  e2b SDK commands.run('true') via the e2b API: p50 %v, p99 %v\n", fmtDur(e), fmtDur(percentile(viaE2B, 99)))
	fmt.Printf("  carrel's Go client (Process stream):           p50 %v, p99 %v\n", fmtDur(g), fmtDur(percentile(viaGo, 99)))
	fmt.Printf("  the façade adds %.0f%% (target <= 10%%): %s\n", (ratio-1)*100, verdict(ratio <= 1.10))

	// MCP exec against the CLI.
	cmd := exec.Command(filepath.Join(d.Bin, "carrel"), "mcp", "--vm", vm)
	cmd.Env = append(os.Environ(), "CARREL_SOCKET="+d.Socket)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	s, err := mcp.NewClient(&mcp.Implementation{Name: "carrel-bench", Version: "v0"}, nil).Connect(ctx, &mcp.CommandTransport{Command: cmd}, nil)
	if err != nil {
		t.Fatalf("carrel mcp: %v", err)
	}
	defer s.Close()
	var viaMCP, viaCLI []time.Duration
	call := func() error {
		res, err := s.CallTool(ctx, &mcp.CallToolParams{Name: "exec", Arguments: map[string]any{"argv": []string{"true"}}})
		if err == nil && res.IsError {
			err = fmt.Errorf("exec tool failed: %v", res.Content)
		}
		return err
	}
	if err := call(); err != nil { // warm
		t.Fatal(err)
	}
	d.Must("exec", vm, "--", "true")
	for len(viaMCP) < runs {
		for range batch {
			start := time.Now()
			if err := call(); err != nil {
				t.Fatal(err)
			}
			viaMCP = append(viaMCP, time.Since(start))
		}
		for range batch {
			start := time.Now()
			d.Must("exec", vm, "--", "true")
			viaCLI = append(viaCLI, time.Since(start))
		}
	}
	m, cl := median(viaMCP), median(viaCLI)
	fmt.Printf("  MCP exec tool (one carrel mcp session, stdio), true: p50 %v, p99 %v\n", fmtDur(m), fmtDur(percentile(viaMCP, 99)))
	fmt.Printf("  carrel exec -- true (a CLI process per call):        p50 %v, p99 %v; MCP/CLI %.2fx\n", fmtDur(cl), fmtDur(percentile(viaCLI, 99)), float64(m)/float64(cl))
	d.Must("vm", "rm", "--force", vm)
}

// e2bRuns runs tests/e2b/bench.cjs: n round trips of commands.run('true').
func e2bRuns(sdk, base, key, vm string, n int) ([]time.Duration, error) {
	cmd := exec.Command(harness.Node(), filepath.Join(harness.RepoRoot(), "tests", "e2b", "bench.cjs"))
	cmd.Env = append(os.Environ(), "NODE_PATH="+sdk, "E2B_API_URL="+base, "E2B_SANDBOX_URL="+base, "E2B_API_KEY="+key,
		"SANDBOX="+vm, fmt.Sprintf("RUNS=%d", n))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("%v: %s", err, stderr.String())
	}
	var ns []int64
	if err := json.Unmarshal(out, &ns); err != nil {
		return nil, fmt.Errorf("bench.cjs printed %q: %v", out, err)
	}
	ds := make([]time.Duration, len(ns))
	for i, v := range ns {
		ds[i] = time.Duration(v)
	}
	return ds, nil
}
