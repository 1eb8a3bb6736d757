package tests

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	filesystempb "github.com/carrel-os/carrel/supervisor/gen/envdpb/filesystem"
	"github.com/carrel-os/carrel/supervisor/gen/envdpb/filesystem/filesystempbconnect"
	"github.com/carrel-os/carrel/tests/harness"
)

// e2bSDK is where make e2b-sdk installs the pinned e2b npm SDK.
func e2bSDK(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(harness.CacheDir(), "npm", "e2b-sdk", "node_modules")
	if _, err := os.Stat(filepath.Join(dir, "e2b", "package.json")); err != nil {
		harness.Unavailable(t, "the e2b SDK is not installed under "+dir+": run make e2b-sdk")
	}
	if _, err := exec.LookPath(harness.Node()); err != nil {
		harness.Unavailable(t, harness.Node()+" is missing: run make e2b-sdk")
	}
	return dir
}

func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// TestE2BSDK drives a carrel VM with the real e2b SDK, unmodified,
// through carreld --e2b-listen: create from a template (a carrel image),
// commands (output, exit codes, env, background with stdin and kill),
// files (write, read, list, watch), list, info and kill. Then the audit
// log has it all, by the key's identity. Then bad input: every case gets
// a clear error and changes nothing.
func TestE2BSDK(t *testing.T) {
	sdk := e2bSDK(t)
	addr := freePort(t)
	const maxUpload = 1 << 20
	d := harness.New(t, "--e2b-listen", addr, "--e2b-max-upload", fmt.Sprint(maxUpload))
	d.Start()
	if r := d.CarrelTimeout(30*time.Minute, "image", "build", "agent"); r.Code != 0 {
		t.Fatalf("image build agent: %+v", r)
	}
	alice := strings.TrimSpace(d.Must("key", "create", "alice", "--image", "agent"))
	bob := strings.TrimSpace(d.Must("key", "create", "bob", "--image", "agent"))
	if !strings.HasPrefix(alice, "e2b_") || strings.Trim(alice[4:], "0123456789abcdef") != "" {
		t.Fatalf("key create printed %q, want e2b_<hex>", alice)
	}
	base := "http://" + addr

	t.Run("sdk", func(t *testing.T) {
		cmd := exec.Command(harness.Node(), filepath.Join(harness.RepoRoot(), "tests", "e2b", "agent.cjs"))
		cmd.Env = append(os.Environ(), "NODE_PATH="+sdk, "E2B_API_URL="+base, "E2B_SANDBOX_URL="+base, "E2B_API_KEY="+alice, "TEMPLATE=agent")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("the e2b SDK script failed: %v\n%s\n%s", err, out, stderr.String())
		}
		var got struct {
			SandboxID string
			Python    struct {
				Stdout, Stderr string
				ExitCode       int
			}
			Env     string
			Failing struct {
				Thrown   bool
				ExitCode int
				Stderr   string
			}
			Read, ReadRelative string
			List               []struct{ Name, Type, Path string }
			Exists, Made       bool
			Watched            []struct{ Name, Type string }
			Background         struct {
				Pid            int
				Echoed, Waited string
				Listed, Killed bool
			}
			Connected string
			Pty       struct{ Answered, Resized, Killed bool }
			Moved     struct {
				Path, Read string
				NotesGone  bool
			}
			Paused, PausedAgain bool
			PausedState         string
			Resumed             struct {
				SleeperAlive bool
				Read         string
			}
			Listed []string
			Info   struct {
				TemplateID string `json:"templateId"`
				State      string
				Metadata   map[string]string
			}
			Running, Killed, KilledAgain bool
		}
		if err := json.Unmarshal(out, &got); err != nil {
			t.Fatalf("script output %q: %v", out, err)
		}
		t.Logf("e2b SDK saw: %s", out)
		check := func(what string, ok bool) {
			t.Helper()
			if !ok {
				t.Errorf("%s: not as expected (output above)", what)
			}
		}
		check("sandbox id in the key's namespace", strings.HasPrefix(got.SandboxID, "e2b-alice-"))
		check("python3 prints 42", got.Python.Stdout == "42\n" && got.Python.ExitCode == 0 && got.Python.Stderr == "")
		check("the sandbox's env and the command's", got.Env == "hello from e2b\nper command\n")
		check("a failing command throws with its exit code and stderr", got.Failing.Thrown && got.Failing.ExitCode == 3 && got.Failing.Stderr == "to-stderr\n")
		check("files read back", got.Read == "hello, carrel" && got.ReadRelative == "relative path")
		check("list", slices.ContainsFunc(got.List, func(e struct{ Name, Type, Path string }) bool {
			return e.Name == "hello.txt" && e.Type == "file" && e.Path == "/workspace/hello.txt"
		}) && slices.ContainsFunc(got.List, func(e struct{ Name, Type, Path string }) bool { return e.Name == "notes" && e.Type == "dir" }))
		check("exists and makeDir", got.Exists && got.Made)
		check("watchDir sees the new file, and no temporary file", slices.Contains(got.Watched, struct{ Name, Type string }{"new.txt", "create"}) &&
			!slices.ContainsFunc(got.Watched, func(e struct{ Name, Type string }) bool { return strings.HasPrefix(e.Name, ".carrel") }))
		check("background: stdin echoed, listed, killed", got.Background.Pid > 0 && got.Background.Echoed == "ping over stdin\n" &&
			got.Background.Listed && got.Background.Killed && got.Background.Waited == "exit -1")
		check("connect follows a command to its end", got.Connected == "done later\n")
		check("a terminal: input, resize, kill", got.Pty.Answered && got.Pty.Resized && got.Pty.Killed)
		check("rename and remove", got.Moved.Path == "/workspace/moved.txt" && got.Moved.Read == "relative path" && got.Moved.NotesGone)
		check("pause keeps the memory: a command runs on after the resume", got.Paused && got.PausedState == "paused" && !got.PausedAgain &&
			got.Resumed.SleeperAlive && got.Resumed.Read == "hello, carrel")
		check("list by metadata", slices.Contains(got.Listed, got.SandboxID))
		check("info", got.Info.TemplateID == "agent" && got.Info.State == "running" && got.Info.Metadata["purpose"] == "carrel-test")
		check("running, then killed once", got.Running && got.Killed && !got.KilledAgain)
		if r := d.Carrel("vm", "inspect", got.SandboxID); r.Code == 0 {
			t.Errorf("the killed sandbox's VM is still there: %s", r.Stdout)
		}

		// The audit log has the session, by the key's identity.
		audit := d.Must("audit", "show", got.SandboxID, "--dir", filepath.Join(d.State, "audit"))
		for _, want := range []string{
			"allow api rule carrel.api.key reason: key alice",
			`exec $ /bin/bash -l -c 'python3 -c "print(6*7)"'`,
			"file.write /workspace/hello.txt by key alice",
			"exec.input",
			"removed",
		} {
			if !strings.Contains(audit, want) {
				t.Errorf("carrel audit show %s has no %q:\n%s", got.SandboxID, want, audit)
			}
		}
	})

	// A sandbox of alice's, made by hand, for the bad input.
	created := e2bCall(t, "POST", base+"/v2/sandboxes", http.Header{"X-Api-Key": {alice}}, `{"templateID":"agent","timeout":600}`)
	if created.status != http.StatusCreated {
		t.Fatalf("create: %d %s", created.status, created.body)
	}
	var sbx struct{ SandboxID, EnvdAccessToken, EnvdVersion string }
	if err := json.Unmarshal([]byte(created.body), &sbx); err != nil {
		t.Fatal(err)
	}
	envd := http.Header{"E2b-Sandbox-Id": {sbx.SandboxID}, "X-Access-Token": {sbx.EnvdAccessToken}}
	vms := func() string { return d.Must("vm", "ls") }
	before := vms()

	t.Run("bad input", func(t *testing.T) {
		cases := []struct {
			name, method, url string
			h                 http.Header
			body              string
			status            int
			says              string
		}{
			{"wrong API key", "POST", "/v2/sandboxes", http.Header{"X-Api-Key": {"e2b_" + strings.Repeat("0", 48)}}, `{"templateID":"agent"}`, 401, "invalid API key"},
			{"no API key", "POST", "/sandboxes", nil, `{"templateID":"agent"}`, 401, "an API key is required"},
			{"a VM token as the API key", "GET", "/v2/sandboxes", http.Header{"X-Api-Key": {sbx.EnvdAccessToken}}, "", 401, "invalid API key"},
			{"malformed JSON", "POST", "/v2/sandboxes", http.Header{"X-Api-Key": {alice}}, `{"templateID":`, 400, "malformed JSON"},
			{"a template the key may not boot", "POST", "/v2/sandboxes", http.Header{"X-Api-Key": {alice}}, `{"templateID":"dev"}`, 403, "carrel.api.key_create"},
			{"unknown sandbox", "GET", "/sandboxes/e2b-alice-ffffffff", http.Header{"X-Api-Key": {alice}}, "", 404, "not found"},
			{"another key's sandbox: get", "GET", "/sandboxes/" + sbx.SandboxID, http.Header{"X-Api-Key": {bob}}, "", 404, "not found"},
			{"another key's sandbox: kill", "DELETE", "/sandboxes/" + sbx.SandboxID, http.Header{"X-Api-Key": {bob}}, "", 404, "not found"},
			{"another key's sandbox: timeout", "POST", "/sandboxes/" + sbx.SandboxID + "/timeout", http.Header{"X-Api-Key": {bob}}, `{"timeout":1}`, 404, "not found"},
			{"an operator's VM by name", "DELETE", "/sandboxes/demo", http.Header{"X-Api-Key": {alice}}, "", 404, "not found"},
			{"negative timeout", "POST", "/sandboxes/" + sbx.SandboxID + "/timeout", http.Header{"X-Api-Key": {alice}}, `{"timeout":-5}`, 400, "timeout"},
			{"envd without a token", "GET", "/health", http.Header{"E2b-Sandbox-Id": {sbx.SandboxID}}, "", 401, "X-Access-Token"},
			{"envd, unknown sandbox", "GET", "/health", http.Header{"E2b-Sandbox-Id": {"e2b-alice-ffffffff"}, "X-Access-Token": {sbx.EnvdAccessToken}}, "", 404, "not found"},
			{"envd, a bad sandbox id", "GET", "/files?path=/etc/hostname", http.Header{"E2b-Sandbox-Id": {"../etc"}, "X-Access-Token": {sbx.EnvdAccessToken}}, "", 400, "E2b-Sandbox-Id"},
			{"path traversal read", "GET", "/files?path=../../etc/shadow", envd, "", 403, "carrel.fs.secret_path"},
			{"path traversal write", "POST", "/files?path=../../etc/evil", withType(envd, "application/octet-stream"), "x", 403, "carrel.fs.default_deny"},
			{"no path", "GET", "/files", envd, "", 400, "path is required"},
			{"missing file", "GET", "/files?path=/workspace/nope", envd, "", 404, ""},
			{"oversized upload", "POST", "/files?path=/workspace/big", withType(envd, "application/octet-stream"), strings.Repeat("x", maxUpload+1), 413, "over"},
			{"malformed multipart", "POST", "/files?path=/workspace/m", withType(envd, "multipart/form-data; boundary=zz"), "--zz\r\nnot a part", 400, "multipart"},
			// A Connect stream's error comes in its end message, under 200.
			{"malformed Connect frame", "POST", "/process.Process/Start", withType(envd, "application/connect+json"), "\x00\x00\x00\x00\x05{bad", 200, `"code":"invalid_argument"`},
			{"malformed Connect JSON", "POST", "/process.Process/Start", withType(envd, "application/connect+json"), "\x00\x00\x00\x00\x04{ba}", 200, `"code":"invalid_argument"`},
			{"malformed unary JSON", "POST", "/filesystem.Filesystem/Stat", withType(envd, "application/json"), `{"path":`, 400, ""},
		}
		for _, c := range cases {
			r := e2bCall(t, c.method, base+c.url, c.h, c.body)
			if r.status != c.status || !strings.Contains(r.body, c.says) {
				t.Errorf("%s: %d %s; want %d saying %q", c.name, r.status, r.body, c.status, c.says)
			}
		}
		// Nothing changed: no VM made or removed, nothing written.
		if after := vms(); after != before {
			t.Errorf("VMs changed:\nbefore:\n%s\nafter:\n%s", before, after)
		}
		for _, p := range []string{"/workspace/big", "/workspace/m", "/etc/evil"} {
			if r := e2bCall(t, "GET", base+"/files?path="+p, envd, ""); r.status != http.StatusNotFound {
				t.Errorf("%s after a refused upload: %d %s, want 404", p, r.status, r.body)
			}
		}
		// A sandbox token acts on its own sandbox only.
		bobs := e2bCall(t, "POST", base+"/v2/sandboxes", http.Header{"X-Api-Key": {bob}}, `{"templateID":"agent"}`)
		if bobs.status != http.StatusCreated {
			t.Fatalf("bob's create: %d %s", bobs.status, bobs.body)
		}
		var bsb struct{ SandboxID, EnvdAccessToken string }
		_ = json.Unmarshal([]byte(bobs.body), &bsb)
		if r := e2bCall(t, "GET", base+"/files?path=/etc/hostname", http.Header{"E2b-Sandbox-Id": {sbx.SandboxID}, "X-Access-Token": {bsb.EnvdAccessToken}}, ""); r.status != http.StatusNotFound {
			t.Errorf("bob's sandbox token on alice's sandbox: %d %s, want 404", r.status, r.body)
		}
		if r := e2bCall(t, "DELETE", base+"/sandboxes/"+bsb.SandboxID, http.Header{"X-Api-Key": {bob}}, ""); r.status != http.StatusNoContent {
			t.Errorf("bob's kill: %d %s", r.status, r.body)
		}
	})

	// The Python SDK's polling watcher, through a Connect client of
	// envd's own wire names (the JS SDK streams WatchDir instead).
	t.Run("polling watcher", func(t *testing.T) {
		fsc := filesystempbconnect.NewFilesystemClient(http.DefaultClient, base, connect.WithProtoJSON(),
			connect.WithInterceptors(headers(envd)))
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		w, err := fsc.CreateWatcher(ctx, connect.NewRequest(&filesystempb.CreateWatcherRequest{Path: "/workspace"}))
		if err != nil {
			t.Fatalf("CreateWatcher: %v", err)
		}
		id := w.Msg.WatcherId
		if r := e2bCall(t, "POST", base+"/files?path=/workspace/polled.txt", withType(envd, "application/octet-stream"), "polled"); r.status != http.StatusOK {
			t.Fatalf("upload: %d %s", r.status, r.body)
		}
		var got []string
		for deadline := time.Now().Add(30 * time.Second); !slices.Contains(got, "polled.txt create") && time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
			evs, err := fsc.GetWatcherEvents(ctx, connect.NewRequest(&filesystempb.GetWatcherEventsRequest{WatcherId: id}))
			if err != nil {
				t.Fatalf("GetWatcherEvents: %v", err)
			}
			for _, ev := range evs.Msg.Events {
				got = append(got, ev.Name+" "+strings.ToLower(strings.TrimPrefix(ev.Type.String(), "EVENT_TYPE_")))
			}
		}
		if !slices.Contains(got, "polled.txt create") || !slices.Contains(got, "polled.txt write") {
			t.Errorf("watcher events %q, want polled.txt's create and write", got)
		}
		if _, err := fsc.RemoveWatcher(ctx, connect.NewRequest(&filesystempb.RemoveWatcherRequest{WatcherId: id})); err != nil {
			t.Fatalf("RemoveWatcher: %v", err)
		}
		if _, err := fsc.GetWatcherEvents(ctx, connect.NewRequest(&filesystempb.GetWatcherEventsRequest{WatcherId: id})); connect.CodeOf(err) != connect.CodeNotFound {
			t.Errorf("GetWatcherEvents after RemoveWatcher: %v, want not found", err)
		}
	})

	t.Run("time to live", func(t *testing.T) {
		if r := e2bCall(t, "POST", base+"/sandboxes/"+sbx.SandboxID+"/timeout", http.Header{"X-Api-Key": {alice}}, `{"timeout":1}`); r.status != http.StatusNoContent {
			t.Fatalf("timeout: %d %s", r.status, r.body)
		}
		deadline := time.Now().Add(time.Minute)
		for d.Carrel("vm", "inspect", sbx.SandboxID).Code == 0 {
			if time.Now().After(deadline) {
				t.Fatalf("sandbox %s outlived its time to live by a minute", sbx.SandboxID)
			}
			time.Sleep(200 * time.Millisecond)
		}
		audit := d.Must("audit", "show", sbx.SandboxID, "--dir", filepath.Join(d.State, "audit"))
		if !strings.Contains(audit, "expired") {
			t.Errorf("no expired record:\n%s", audit)
		}
	})
}

// headers sets h on every Connect call.
func headers(h http.Header) connect.UnaryInterceptorFunc {
	return func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			for k, v := range h {
				req.Header()[k] = v
			}
			return next(ctx, req)
		}
	}
}

func withType(h http.Header, ct string) http.Header {
	h = h.Clone()
	h.Set("Content-Type", ct)
	return h
}

type e2bReply struct {
	status int
	body   string
}

func e2bCall(t *testing.T, method, url string, h http.Header, body string) e2bReply {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range h {
		req.Header[k] = v
	}
	if req.Header.Get("Content-Type") == "" && body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	c := &http.Client{Timeout: 3 * time.Minute}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return e2bReply{resp.StatusCode, string(b)}
}
