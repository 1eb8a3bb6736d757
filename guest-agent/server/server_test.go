//go:build linux

package server

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/guest-agent/exec"
	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/guest-agent/reaper"
)

func TestMain(m *testing.M) {
	// Orphans of killed process groups come back to us and get reaped.
	_ = unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
	os.Exit(m.Run())
}

type fixture struct {
	client agentv1connect.AgentServiceClient
	files  agentv1connect.FileServiceClient
	hc     *http.Client
	dials  atomic.Int32
	dir    string
	cancel context.CancelFunc
	served chan error
	reboot chan bool
}

// serve starts the server on a unix socket and returns a client for it;
// configure, if given, adjusts its Config first.
func serve(t *testing.T, configure ...func(*Config)) *fixture {
	t.Helper()
	f := &fixture{dir: t.TempDir(), served: make(chan error, 1), reboot: make(chan bool, 1)}
	sock := filepath.Join(t.TempDir(), "agent.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	f.cancel = cancel
	cfg := Config{
		Transport: "unix",
		Runner:    &exec.Runner{Reaper: reaper.Default(), Dir: f.dir, User: testUser(), WaitDelay: 200 * time.Millisecond},
		PowerOff:  func(reboot bool) { f.reboot <- reboot },
	}
	for _, c := range configure {
		c(&cfg)
	}
	go func() { f.served <- Serve(ctx, l, cfg) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-f.served:
		case <-time.After(5 * time.Second):
			t.Error("Serve did not return after cancel")
		}
	})
	hc, tr := protocol.NewHTTPClient(func(ctx context.Context) (net.Conn, error) {
		f.dials.Add(1)
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	})
	t.Cleanup(tr.CloseIdleConnections)
	f.hc = hc
	f.client = agentv1connect.NewAgentServiceClient(hc, protocol.BaseURL, protocol.ClientOptions()...)
	f.files = agentv1connect.NewFileServiceClient(hc, protocol.BaseURL, protocol.ClientOptions()...)
	return f
}

// testUser is who tests run commands as: root when the tests run as root
// (as in CI), else the tests' own user, the only one a non-root agent can
// run commands as.
func testUser() string {
	if os.Geteuid() == 0 {
		return "root"
	}
	return ""
}

func callCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

type execResult struct {
	pid            int32
	stdout, stderr bytes.Buffer
	exit           *agentv1.ExitStatus
}

func execute(ctx context.Context, c agentv1connect.AgentServiceClient, req *agentv1.ExecRequest) (*execResult, error) {
	stream, err := c.Exec(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	defer stream.Close()
	res := &execResult{}
	for stream.Receive() {
		switch e := stream.Msg().Event.(type) {
		case *agentv1.ExecResponse_Started:
			res.pid = e.Started.Pid
		case *agentv1.ExecResponse_Stdout:
			res.stdout.Write(e.Stdout)
		case *agentv1.ExecResponse_Stderr:
			res.stderr.Write(e.Stderr)
		case *agentv1.ExecResponse_Exit:
			res.exit = e.Exit
		}
	}
	if err := stream.Err(); err != nil {
		return res, err
	}
	if res.exit == nil {
		return res, errors.New("stream ended without exit status")
	}
	return res, nil
}

func sh(script string) *agentv1.ExecRequest {
	return &agentv1.ExecRequest{Argv: []string{"sh", "-c", script}}
}

func TestHealth(t *testing.T) {
	f := serve(t)
	resp, err := f.client.Health(callCtx(t), connect.NewRequest(&agentv1.HealthRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	h := resp.Msg
	if h.Version != "dev" || h.Kernel == "" || h.Transport != "unix" || h.UptimeMs < 0 {
		t.Fatalf("health %v", h)
	}
}

func TestExecOutputAndExitCode(t *testing.T) {
	f := serve(t)
	res, err := execute(callCtx(t), f.client, sh("echo out; echo err >&2; exit 3"))
	if err != nil {
		t.Fatal(err)
	}
	if res.pid <= 0 || res.exit.Code != 3 || res.stdout.String() != "out\n" || res.stderr.String() != "err\n" {
		t.Fatalf("pid %d exit %v stdout %q stderr %q", res.pid, res.exit, res.stdout.String(), res.stderr.String())
	}
}

func TestExecLargeOutput(t *testing.T) {
	f := serve(t)
	data := make([]byte, 8<<20)
	rand.Read(data)
	file := filepath.Join(f.dir, "data")
	if err := os.WriteFile(file, data, 0o644); err != nil {
		t.Fatal(err)
	}
	res, err := execute(callCtx(t), f.client, &agentv1.ExecRequest{Argv: []string{"cat", "data"}})
	if err != nil {
		t.Fatal(err)
	}
	if res.stdout.Len() != len(data) || sha256.Sum256(res.stdout.Bytes()) != sha256.Sum256(data) {
		t.Fatalf("got %d bytes, want %d with the same sha256", res.stdout.Len(), len(data))
	}
}

func TestExecKilledBySignal(t *testing.T) {
	f := serve(t)
	res, err := execute(callCtx(t), f.client, sh("kill -KILL $$"))
	if err != nil {
		t.Fatal(err)
	}
	if res.exit.Code != 137 || res.exit.Signal != "SIGKILL" {
		t.Fatalf("exit %v, want 137 SIGKILL", res.exit)
	}
}

func TestExecNotFound(t *testing.T) {
	f := serve(t)
	_, err := execute(callCtx(t), f.client, &agentv1.ExecRequest{Argv: []string{"carrel-no-such-cmd"}})
	want := `exec: "carrel-no-such-cmd": executable file not found in $PATH`
	if connect.CodeOf(err) != connect.CodeNotFound || !strings.Contains(err.Error(), want) {
		t.Fatalf("err %v, want not_found %q", err, want)
	}
	_, err = execute(callCtx(t), f.client, &agentv1.ExecRequest{})
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("empty argv: %v, want invalid_argument", err)
	}
}

func TestExecCancelKillsGroup(t *testing.T) {
	f := serve(t)
	ctx, cancel := context.WithCancel(callCtx(t))
	stream, err := f.client.Exec(ctx, connect.NewRequest(sh("sleep 300 & echo $!; wait")))
	if err != nil {
		t.Fatal(err)
	}
	var leader int32
	var child int
	for child == 0 && stream.Receive() {
		switch e := stream.Msg().Event.(type) {
		case *agentv1.ExecResponse_Started:
			leader = e.Started.Pid
		case *agentv1.ExecResponse_Stdout:
			child, err = strconv.Atoi(strings.TrimSpace(string(e.Stdout)))
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	if child == 0 {
		t.Fatalf("no child pid: %v", stream.Err())
	}
	cancel()
	stream.Close()
	waitGone(t, int(leader))
	waitGone(t, child)
}

func waitGone(t *testing.T, pid int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); errors.Is(err, os.ErrNotExist) {
			return
		}
		if time.Now().After(deadline) {
			stat, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
			t.Fatalf("pid %d still there: %s", pid, stat)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestConcurrentExecsShareOneConnection(t *testing.T) {
	f := serve(t)
	const n = 32
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			res, err := execute(callCtx(t), f.client, sh(fmt.Sprintf("sleep 0.2; head -c 100000 /dev/zero; echo %d >&2; exit %d", i, i)))
			if err != nil {
				t.Errorf("exec %d: %v", i, err)
				return
			}
			if int(res.exit.Code) != i || res.stdout.Len() != 100000 || res.stderr.String() != fmt.Sprintf("%d\n", i) {
				t.Errorf("exec %d: exit %v, %d bytes, stderr %q", i, res.exit, res.stdout.Len(), res.stderr.String())
			}
		})
	}
	wg.Wait()
	if d := f.dials.Load(); d != 1 {
		t.Fatalf("%d connections, want 1", d)
	}
}

func TestUnknownMethod(t *testing.T) {
	f := serve(t)
	for _, proc := range []string{"/carrel.agent.v1.AgentService/Nope", "/carrel.agent.v1.FileService/Nope", "/grpc.health.v1.Health/Check"} {
		c := connect.NewClient[agentv1.HealthRequest, agentv1.HealthResponse](f.hc, protocol.BaseURL+proc, protocol.ClientOptions()...)
		_, err := c.CallUnary(callCtx(t), connect.NewRequest(&agentv1.HealthRequest{}))
		if connect.CodeOf(err) != connect.CodeUnimplemented {
			t.Errorf("%s: %v, want unimplemented", proc, err)
		}
	}
}

// TestFilesAndExecShareOneConnection writes a file through FileService and
// reads it back through Exec, over the one connection.
func TestFilesAndExecShareOneConnection(t *testing.T) {
	f := serve(t)
	ctx := callCtx(t)
	w := f.files.Write(ctx)
	for _, m := range []*agentv1.WriteRequest{
		{Msg: &agentv1.WriteRequest_Header{Header: &agentv1.WriteHeader{Path: f.dir + "/sub/hello", MakeParents: true}}},
		{Msg: &agentv1.WriteRequest_Data{Data: []byte("hello\n")}},
		{Msg: &agentv1.WriteRequest_Commit{Commit: &agentv1.WriteCommit{}}},
	} {
		if err := w.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := w.CloseAndReceive(); err != nil {
		t.Fatal(err)
	}
	res, err := execute(ctx, f.client, &agentv1.ExecRequest{Argv: []string{"cat", "sub/hello"}})
	if err != nil {
		t.Fatal(err)
	}
	if res.stdout.String() != "hello\n" {
		t.Fatalf("cat: %q", res.stdout.String())
	}
	st, err := f.files.Stat(ctx, connect.NewRequest(&agentv1.StatRequest{Path: f.dir + "/sub/hello"}))
	if err != nil {
		t.Fatal(err)
	}
	if st.Msg.Info.Size != 6 || st.Msg.Info.Mode != 0o644 {
		t.Fatalf("stat %v", st.Msg.Info)
	}
	if d := f.dials.Load(); d != 1 {
		t.Fatalf("%d connections, want 1", d)
	}
}

func TestShutdown(t *testing.T) {
	f := serve(t)
	_, err := f.client.Shutdown(callCtx(t), connect.NewRequest(&agentv1.ShutdownRequest{Reboot: true}))
	if err != nil {
		t.Fatal(err)
	}
	select {
	case reboot := <-f.reboot:
		if !reboot {
			t.Fatal("PowerOff(false), want reboot")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("PowerOff not called")
	}
	select {
	case err := <-f.served:
		if err != nil {
			t.Fatalf("Serve: %v", err)
		}
		f.served <- nil // for the cleanup
	case <-time.After(5 * time.Second):
		t.Fatal("Serve did not return")
	}
}
