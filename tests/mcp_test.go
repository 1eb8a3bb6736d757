package tests

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/carrel-os/carrel/tests/harness"
)

// mcpSession starts `carrel mcp args...` against d and connects the MCP Go
// SDK's client to it over stdio.
func mcpSession(t *testing.T, d *harness.Daemon, args ...string) *mcp.ClientSession {
	t.Helper()
	cmd := exec.Command(filepath.Join(d.Bin, "carrel"), append([]string{"mcp"}, args...)...)
	cmd.Env = append(os.Environ(), "CARREL_SOCKET="+d.Socket)
	cmd.Stderr = os.Stderr
	c := mcp.NewClient(&mcp.Implementation{Name: "carrel-tests", Version: "v0"}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := c.Connect(ctx, &mcp.CommandTransport{Command: cmd}, nil)
	if err != nil {
		t.Fatalf("connect to carrel mcp: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// call calls tool and decodes its structured output into out (nil to
// skip); it returns the tool's error text, "" when it succeeded.
func call(t *testing.T, s *mcp.ClientSession, tool string, args map[string]any, out any) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res, err := s.CallTool(ctx, &mcp.CallToolParams{Name: tool, Arguments: args})
	if err != nil {
		t.Fatalf("%s: %v", tool, err)
	}
	if res.IsError {
		var text []string
		for _, c := range res.Content {
			if tc, ok := c.(*mcp.TextContent); ok {
				text = append(text, tc.Text)
			}
		}
		return strings.Join(text, "\n")
	}
	if out != nil {
		b, _ := json.Marshal(res.StructuredContent)
		if err := json.Unmarshal(b, out); err != nil {
			t.Fatalf("%s: output %s: %v", tool, b, err)
		}
	}
	return ""
}

// TestMCP drives a real VM through `carrel mcp` with the MCP Go SDK's own
// client: every tool, a call the VM's policy denies (its error names the
// rule), and a token scoped to another VM, refused.
func TestMCP(t *testing.T) {
	d := harness.New(t)
	d.Start()
	d.BuildImage()
	d.Must("vm", "create", "m", "--policy", "locked-down", "--memory", "256M")
	s := mcpSession(t, d, "--vm", "m")

	tools, err := s.ListTools(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, tool := range tools.Tools {
		names = append(names, tool.Name)
		if tool.InputSchema == nil || tool.OutputSchema == nil {
			t.Errorf("tool %s has no input or output schema", tool.Name)
		}
	}
	for _, want := range []string{"exec", "read_file", "write_file", "list_dir", "stat", "make_dir", "remove", "move", "vm_list", "search_files", "port_forward", "snapshot", "restore", "fork"} {
		if !slices.Contains(names, want) {
			t.Errorf("tools %v lack %s", names, want)
		}
	}

	var ex struct {
		ExitCode        int    `json:"exit_code"`
		Stdout          string `json:"stdout"`
		Stderr          string `json:"stderr"`
		StdoutTruncated bool   `json:"stdout_truncated"`
	}
	if e := call(t, s, "exec", map[string]any{"command": "echo out; echo err >&2; exit 3"}, &ex); e != "" || ex.ExitCode != 3 || ex.Stdout != "out\n" || ex.Stderr != "err\n" {
		t.Errorf("exec: %+v %s", ex, e)
	}
	if e := call(t, s, "exec", map[string]any{"argv": []string{"cat"}, "stdin": "fed", "cwd": "/workspace", "env": map[string]string{"X": "1"}}, &ex); e != "" || ex.Stdout != "fed" {
		t.Errorf("exec with stdin: %+v %s", ex, e)
	}
	if e := call(t, s, "exec", map[string]any{"command": "head -c 3000000 /dev/zero | tr '\\0' a"}, &ex); e != "" || len(ex.Stdout) != 1<<20 || !ex.StdoutTruncated {
		t.Errorf("exec of 3 MB: %d bytes, truncated %v, %s", len(ex.Stdout), ex.StdoutTruncated, e)
	}
	if e := call(t, s, "exec", map[string]any{"command": "sleep 30", "timeout_seconds": 1}, nil); !strings.Contains(e, "did not finish") {
		t.Errorf("exec past its timeout: %q", e)
	}

	var w struct {
		Bytes int64 `json:"bytes"`
	}
	if e := call(t, s, "write_file", map[string]any{"path": "/workspace/d/a.txt", "content": "hello\n", "make_parents": true}, &w); e != "" || w.Bytes != 6 {
		t.Errorf("write_file: %+v %s", w, e)
	}
	var r struct {
		Content  string `json:"content"`
		Encoding string `json:"encoding"`
		Size     int64  `json:"size"`
	}
	if e := call(t, s, "read_file", map[string]any{"path": "/workspace/d/a.txt"}, &r); e != "" || r.Content != "hello\n" || r.Encoding != "utf-8" || r.Size != 6 {
		t.Errorf("read_file: %+v %s", r, e)
	}
	if e := call(t, s, "write_file", map[string]any{"path": "/workspace/d/b.bin", "content": "AP8=", "encoding": "base64"}, nil); e != "" {
		t.Errorf("write_file base64: %s", e)
	}
	if e := call(t, s, "read_file", map[string]any{"path": "/workspace/d/b.bin"}, &r); e != "" || r.Content != "AP8=" || r.Encoding != "base64" {
		t.Errorf("read_file of bytes: %+v %s", r, e)
	}
	if e := call(t, s, "make_dir", map[string]any{"path": "/workspace/d/sub"}, nil); e != "" {
		t.Errorf("make_dir: %s", e)
	}
	if e := call(t, s, "move", map[string]any{"from": "/workspace/d/a.txt", "to": "/workspace/d/sub/c.txt"}, nil); e != "" {
		t.Errorf("move: %s", e)
	}
	var st struct {
		Type string `json:"type"`
		Size int64  `json:"size"`
	}
	if e := call(t, s, "stat", map[string]any{"path": "/workspace/d/sub/c.txt"}, &st); e != "" || st.Type != "file" || st.Size != 6 {
		t.Errorf("stat: %+v %s", st, e)
	}
	var ls struct {
		Entries []struct {
			Path string `json:"path"`
			Type string `json:"type"`
		} `json:"entries"`
	}
	if e := call(t, s, "list_dir", map[string]any{"path": "/workspace/d", "recursive": true}, &ls); e != "" || len(ls.Entries) != 3 {
		t.Errorf("list_dir: %+v %s", ls, e)
	}
	var found struct {
		Matches []struct {
			Path string `json:"path"`
			Line int    `json:"line"`
			Text string `json:"text"`
		} `json:"matches"`
	}
	if e := call(t, s, "search_files", map[string]any{"path": "/workspace", "name": "*.txt", "content": "^hel+o$"}, &found); e != "" ||
		len(found.Matches) != 1 || found.Matches[0].Path != "/workspace/d/sub/c.txt" || found.Matches[0].Line != 1 || found.Matches[0].Text != "hello" {
		t.Errorf("search_files by content: %+v %s", found, e)
	}
	if e := call(t, s, "search_files", map[string]any{"path": "/workspace", "name": "*.bin"}, &found); e != "" || len(found.Matches) != 1 || found.Matches[0].Path != "/workspace/d/b.bin" {
		t.Errorf("search_files by name: %+v %s", found, e)
	}
	if e := call(t, s, "search_files", map[string]any{"path": "-delete", "name": "x"}, nil); !strings.Contains(e, "absolute path") {
		t.Errorf("search_files from an option: %q", e)
	}
	// Snapshot, change, restore: the change is gone. A fork is a VM of its
	// own.
	var snap struct {
		Name       string `json:"name"`
		StateBytes uint64 `json:"state_bytes"`
	}
	if e := call(t, s, "snapshot", map[string]any{"name": "s1"}, &snap); e != "" || snap.Name != "s1" || snap.StateBytes == 0 {
		t.Errorf("snapshot: %+v %s", snap, e)
	}
	call(t, s, "write_file", map[string]any{"path": "/workspace/later", "content": "x"}, nil)
	if e := call(t, s, "restore", map[string]any{"snapshot": "s1"}, nil); e != "" {
		t.Errorf("restore: %s", e)
	}
	if e := call(t, s, "stat", map[string]any{"path": "/workspace/later"}, nil); !strings.Contains(e, "not_found") {
		t.Errorf("a file written after the snapshot, after the restore: %q", e)
	}
	var forked struct {
		Name  string `json:"name"`
		State string `json:"state"`
	}
	if e := call(t, s, "fork", map[string]any{"new_name": "mf", "snapshot": "s1"}, &forked); e != "" || forked.Name != "mf" || forked.State != "running" {
		t.Errorf("fork: %+v %s", forked, e)
	}
	d.Must("vm", "rm", "--force", "mf")
	if e := call(t, s, "remove", map[string]any{"path": "/workspace/d", "recursive": true}, nil); e != "" {
		t.Errorf("remove: %s", e)
	}
	if e := call(t, s, "stat", map[string]any{"path": "/workspace/d"}, nil); !strings.Contains(e, "not_found") {
		t.Errorf("stat after remove: %q", e)
	}
	var vms struct {
		VMs []struct {
			Name  string `json:"name"`
			State string `json:"state"`
		} `json:"vms"`
	}
	if e := call(t, s, "vm_list", nil, &vms); e != "" || len(vms.VMs) != 1 || vms.VMs[0].Name != "m" || vms.VMs[0].State != "running" {
		t.Errorf("vm_list: %+v %s", vms, e)
	}

	// Denied by the VM's policy, naming the rule; nothing happens.
	for _, c := range []struct {
		tool string
		args map[string]any
		rule string
	}{
		{"read_file", map[string]any{"path": "/etc/shadow"}, "carrel.fs.secret_path"},
		{"write_file", map[string]any{"path": "/tmp/f", "content": "x"}, "carrel.fs.default_deny"},
		{"exec", map[string]any{"argv": []string{"wget", "http://example.com"}}, "carrel.exec.denied_command"},
		{"port_forward", map[string]any{"action": "start", "guest_port": 8080}, "carrel.net.default_deny"},
	} {
		if e := call(t, s, c.tool, c.args, nil); !strings.Contains(e, "denied by policy locked-down") || !strings.Contains(e, c.rule) {
			t.Errorf("%s %v: %q; want a deny naming %s", c.tool, c.args, e, c.rule)
		}
	}
	// The VM's audit timeline, with those denies, and its console.
	checkResources(t, s, "m")
	// A server scoped to one VM takes no other.
	if e := call(t, s, "exec", map[string]any{"vm": "other", "argv": []string{"true"}}, nil); !strings.Contains(e, `acts on vm "m" only`) {
		t.Errorf("exec in another vm: %q", e)
	}
	// A token is its VM's only.
	token := strings.TrimSpace(d.Must("token", "create", "m"))
	ts := mcpSession(t, d, "--token", token)
	if e := call(t, ts, "exec", map[string]any{"vm": "m", "argv": []string{"true"}}, nil); e != "" {
		t.Errorf("exec with m's token in m: %s", e)
	}
	if e := call(t, ts, "exec", map[string]any{"vm": "other", "argv": []string{"true"}}, nil); !strings.Contains(e, "permission_denied") {
		t.Errorf("exec with m's token in another vm: %q", e)
	}
	t.Run("http", func(t *testing.T) { mcpOverHTTP(t, d, token) })
	// Unscoped, an operator's server makes and removes VMs.
	all := mcpSession(t, d)
	var made struct {
		Name  string `json:"name"`
		State string `json:"state"`
	}
	if e := call(t, all, "vm_create", map[string]any{"name": "m2", "memory_bytes": 256 << 20}, &made); e != "" || made.State != "running" {
		t.Errorf("vm_create: %+v %s", made, e)
	}
	// Under the default policy, a port forward carries a connection to a
	// server in the VM.
	d.Must("exec", "m2", "--", "sh", "-c", "mkdir -p /workspace/www && echo served > /workspace/www/index.html")
	d.Must("exec", "--detach", "m2", "--", "busybox", "httpd", "-f", "-p", "127.0.0.1:8080", "-h", "/workspace/www")
	var fw struct {
		Forwards []struct {
			ID    int    `json:"id"`
			Local string `json:"local"`
		} `json:"forwards"`
	}
	waitFor(t, 30*time.Second, "the forward to the guest's httpd", func() bool {
		return call(t, all, "port_forward", map[string]any{"vm": "m2", "action": "start", "guest_port": 8080}, &fw) == "" && len(fw.Forwards) == 1
	})
	local, id := fw.Forwards[0].Local, fw.Forwards[0].ID
	resp, err := http.Get("http://" + local + "/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(body) != "served\n" {
		t.Errorf("through the forward: %q", body)
	}
	if e := call(t, all, "port_forward", map[string]any{"action": "stop", "id": id}, nil); e != "" {
		t.Errorf("stop the forward: %s", e)
	}
	if e := call(t, all, "port_forward", map[string]any{"action": "list"}, &fw); e != "" || len(fw.Forwards) != 0 {
		t.Errorf("forwards after stop: %+v %s", fw, e)
	}
	if _, err := http.Get("http://" + local + "/"); err == nil {
		t.Error("the stopped forward still answers")
	}
	if e := call(t, all, "vm_remove", map[string]any{"name": "m2"}, nil); e != "" {
		t.Errorf("vm_remove: %s", e)
	}
	if e := call(t, all, "exec", map[string]any{"argv": []string{"true"}}, nil); !strings.Contains(e, "name the vm") {
		t.Errorf("an unscoped exec naming no vm: %q", e)
	}
	if out := d.Must("audit", "verify", "--dir", filepath.Join(d.State, "audit")); !strings.Contains(out, "ok: the log is intact") {
		t.Errorf("audit verify: %s", out)
	}
	d.Must("vm", "rm", "--force", "m")
}

// checkResources: a session scoped to vm lists its audit timeline and
// its console as resources, and reads them: the timeline has the denies
// TestMCP made, the console what the guest's agent printed there as it
// booted.
func checkResources(t *testing.T, s *mcp.ClientSession, vm string) {
	t.Helper()
	ctx := context.Background()
	list, err := s.ListResources(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	var uris []string
	for _, r := range list.Resources {
		uris = append(uris, r.URI)
	}
	audit, console := "carrel://vm/"+vm+"/audit", "carrel://vm/"+vm+"/console"
	if !slices.Equal(uris, []string{audit, console}) {
		t.Errorf("resources %v", uris)
	}
	read := func(uri string) string {
		res, err := s.ReadResource(ctx, &mcp.ReadResourceParams{URI: uri})
		if err != nil {
			t.Fatalf("read %s: %v", uri, err)
		}
		if len(res.Contents) != 1 || res.Contents[0].MIMEType != "text/plain" {
			t.Fatalf("read %s: %+v", uri, res.Contents)
		}
		return res.Contents[0].Text
	}
	timeline := read(audit)
	for _, want := range []string{"TIME (UTC)", "vm.lifecycle", "exec.exit", "deny fs rule carrel.fs.secret_path", "deny exec rule carrel.exec.denied_command"} {
		if !strings.Contains(timeline, want) {
			t.Errorf("the timeline lacks %q:\n%s", want, timeline)
		}
	}
	if lines := strings.Count(timeline, "\n"); lines > 202 {
		t.Errorf("the timeline has %d lines; the resource holds 200 records", lines)
	}
	text := read(console)
	if !strings.Contains(text, "carrel-agent: ready") || strings.ContainsAny(text, "\x1b\r") || len(text) > 65<<10 {
		t.Errorf("the console (%d bytes) lacks the agent's ready line or has control characters:\n%s", len(text), text)
	}
}

// bearerRT adds a bearer token and, when set, a Host header to each
// request.
type bearerRT struct {
	token, host string
}

func (b bearerRT) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	if b.token != "" {
		r.Header.Set("Authorization", "Bearer "+b.token)
	}
	if b.host != "" {
		r.Host = b.host
	}
	return http.DefaultTransport.RoundTrip(r)
}

// mcpOverHTTP: `carrel mcp --listen` serves vm m to a client with m's
// token, with --vm m and without (the token says which VM); a request
// without a token, or with a made-up one, gets 401; a Host that is not a
// loopback name gets 403 (DNS rebinding).
func mcpOverHTTP(t *testing.T, d *harness.Daemon, token string) {
	if r := d.Carrel("mcp", "--vm", "m", "--listen", "0.0.0.0:0"); r.Code == 0 || !strings.Contains(r.Stderr, "loopback") {
		t.Errorf("--listen on every address: %+v", r)
	}
	url := mcpListen(t, d, "--vm", "m")
	post := func(rt bearerRT) int {
		req, _ := http.NewRequest("POST", url, strings.NewReader(`{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"0"}}}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		resp, err := (&http.Client{Transport: rt}).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := post(bearerRT{}); code != http.StatusUnauthorized {
		t.Errorf("no token: %d, want 401", code)
	}
	if code := post(bearerRT{token: "carrel_0000000000000000_00000000000000000000000000000000"}); code != http.StatusUnauthorized {
		t.Errorf("a made-up token: %d, want 401", code)
	}
	if code := post(bearerRT{token: token, host: "evil.example:80"}); code != http.StatusForbidden {
		t.Errorf("a foreign Host: %d, want 403", code)
	}
	// Served with --vm m, and without: then the token says which VM.
	for _, url := range []string{url, mcpListen(t, d)} {
		s := httpSession(t, url, token)
		var ex struct {
			ExitCode int    `json:"exit_code"`
			Stdout   string `json:"stdout"`
		}
		if e := call(t, s, "exec", map[string]any{"argv": []string{"echo", "over http"}}, &ex); e != "" || ex.Stdout != "over http\n" {
			t.Errorf("%s: exec over http: %+v %s", url, ex, e)
		}
		if e := call(t, s, "read_file", map[string]any{"path": "/etc/shadow"}, nil); !strings.Contains(e, "carrel.fs.secret_path") {
			t.Errorf("%s: a denied read over http: %q", url, e)
		}
		var vms struct {
			VMs []struct {
				Name string `json:"name"`
			} `json:"vms"`
		}
		if e := call(t, s, "vm_list", nil, &vms); e != "" || len(vms.VMs) != 1 || vms.VMs[0].Name != "m" {
			t.Errorf("%s: vm_list with m's token: %+v %s", url, vms, e)
		}
		checkResources(t, s, "m")
	}
}

// mcpListen starts `carrel mcp args... --listen` on a free loopback port
// and returns its URL.
func mcpListen(t *testing.T, d *harness.Daemon, args ...string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	cmd := exec.Command(filepath.Join(d.Bin, "carrel"), append(append([]string{"mcp"}, args...), "--listen", addr)...)
	cmd.Env = append(os.Environ(), "CARREL_SOCKET="+d.Socket)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Signal(syscall.SIGTERM); cmd.Wait() })
	waitFor(t, 10*time.Second, "carrel mcp --listen", func() bool {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
	return "http://" + addr + "/mcp"
}

// httpSession connects the MCP Go SDK's client to url with token.
func httpSession(t *testing.T, url, token string) *mcp.ClientSession {
	t.Helper()
	c := mcp.NewClient(&mcp.Implementation{Name: "carrel-tests", Version: "v0"}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := c.Connect(ctx, &mcp.StreamableClientTransport{Endpoint: url, HTTPClient: &http.Client{Transport: bearerRT{token: token}}}, nil)
	if err != nil {
		t.Fatalf("connect to %s: %v", url, err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}
