package api

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/image/store/storetest"
	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/supervisor/driver/drivertest"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
	"github.com/carrel-os/carrel/supervisor/registry"
	"github.com/carrel-os/carrel/supervisor/relay"
	"github.com/carrel-os/carrel/supervisor/vm"
)

// serveAPI runs the API over a fake driver and returns the socket path.
func serveAPI(t *testing.T) string {
	sock, _ := serveAPIWith(t)
	return sock
}

// serveAPIWith is serveAPI, also returning the fake driver to script VMs.
func serveAPIWith(t *testing.T) (string, *drivertest.Driver) {
	t.Helper()
	dir := t.TempDir()
	img, _ := storetest.WithFakeImage(t, dir, "dev")
	reg, _ := registry.Open(filepath.Join(dir, "vms"))
	drv := drivertest.New()
	m := vm.New(vm.Config{Registry: reg, Images: img, Driver: drv, BootTimeout: 2 * time.Second})
	t.Cleanup(func() { m.Close() })
	sock := filepath.Join(dir, "api.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- Serve(ctx, l, Handler(Config{Manager: m, Images: img})) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	return sock, drv
}

func TestVMServiceOverGRPC(t *testing.T) {
	c := client.New(serveAPI(t))
	ctx := context.Background()
	resp, err := c.VMs.CreateVM(ctx, connect.NewRequest(&apiv1.CreateVMRequest{Name: "demo", Image: "dev"}))
	if err != nil {
		t.Fatal(err)
	}
	v := resp.Msg.Vm
	if v.State != apiv1.VMState_VM_STATE_RUNNING || v.AgentState != apiv1.AgentState_AGENT_STATE_READY || v.Pid == 0 || v.MemoryBytes != vm.DefaultMemory {
		t.Errorf("created vm = %v", v)
	}

	codes := []struct {
		req  *apiv1.CreateVMRequest
		code connect.Code
	}{
		{&apiv1.CreateVMRequest{Name: "demo", Image: "dev"}, connect.CodeAlreadyExists},
		{&apiv1.CreateVMRequest{Name: "UPPER", Image: "dev"}, connect.CodeInvalidArgument},
		{&apiv1.CreateVMRequest{Name: "x", Image: "missing"}, connect.CodeNotFound},
		{&apiv1.CreateVMRequest{Name: "x", Image: "dev", Cpus: 1000}, connect.CodeInvalidArgument},
	}
	for _, c2 := range codes {
		if _, err := c.VMs.CreateVM(ctx, connect.NewRequest(c2.req)); connect.CodeOf(err) != c2.code {
			t.Errorf("%v: %v, want %v", c2.req, err, c2.code)
		}
	}

	stream, err := c.VMs.Exec(ctx, connect.NewRequest(&apiv1.ExecRequest{Vm: "demo", Argv: []string{"a", "b"}}))
	if err != nil {
		t.Fatal(err)
	}
	var out string
	var exit *apiv1.ExitStatus
	for stream.Receive() {
		out += string(stream.Msg().GetStdout())
		if e := stream.Msg().GetExit(); e != nil {
			exit = e
		}
	}
	if err := stream.Err(); err != nil || out != "a\nb\n" || exit == nil || exit.Code != 0 {
		t.Errorf("exec: out %q exit %v err %v", out, exit, err)
	}

	stream, _ = c.VMs.Exec(ctx, connect.NewRequest(&apiv1.ExecRequest{Vm: "demo"}))
	for stream.Receive() {
	}
	if connect.CodeOf(stream.Err()) != connect.CodeInvalidArgument {
		t.Errorf("exec without argv: %v", stream.Err())
	}
	stream, _ = c.VMs.Exec(ctx, connect.NewRequest(&apiv1.ExecRequest{Vm: "nope", Argv: []string{"x"}}))
	for stream.Receive() {
	}
	if connect.CodeOf(stream.Err()) != connect.CodeNotFound {
		t.Errorf("exec in missing vm: %v", stream.Err())
	}

	if _, err := c.VMs.DeleteVM(ctx, connect.NewRequest(&apiv1.DeleteVMRequest{Name: "demo"})); connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Errorf("delete running: %v", err)
	}
	if _, err := c.VMs.DeleteVM(ctx, connect.NewRequest(&apiv1.DeleteVMRequest{Name: "demo", Force: true})); err != nil {
		t.Fatal(err)
	}
	list, err := c.VMs.ListVMs(ctx, connect.NewRequest(&apiv1.ListVMsRequest{}))
	if err != nil || len(list.Msg.Vms) != 0 {
		t.Errorf("list after delete: %v %v", list, err)
	}
}

// TestPlainHTTPJSON shows that curl-style clients work: HTTP/1.1, JSON.
func TestPlainHTTPJSON(t *testing.T) {
	sock := serveAPI(t)
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}}
	post := func(path, body string) (int, string) {
		resp, err := hc.Post("http://carreld"+path, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	code, body := post("/carrel.api.v1.VMService/CreateVM", `{"name":"web","image":"dev"}`)
	if code != 200 || !strings.Contains(body, `"VM_STATE_RUNNING"`) {
		t.Errorf("create: %d %s", code, body)
	}
	code, body = post("/carrel.api.v1.VMService/ListVMs", `{}`)
	if code != 200 || !strings.Contains(body, `"name":"web"`) {
		t.Errorf("list: %d %s", code, body)
	}
	code, body = post("/carrel.api.v1.VMService/GetVM", `{"name":"nope"}`)
	if code != 404 || !strings.Contains(body, "not_found") {
		t.Errorf("get missing: %d %s", code, body)
	}
	if code, _ = post("/carrel.api.v1.VMService/NoSuchMethod", `{}`); code != 404 {
		t.Errorf("unknown method: %d", code)
	}
	if code, _ = post("/carrel.api.v1.VMService/CreateVM", strings.Repeat("x", maxRequestBytes+1)); code == 200 {
		t.Errorf("oversized request accepted")
	}
}

func TestGuestErrorsAreSanitized(t *testing.T) {
	// What a hostile guest could send: a code that poses as carreld's,
	// terminal escapes, a huge message, and headers to smuggle through.
	ge := connect.NewWireError(connect.CodeUnauthenticated, errors.New("\x1b[2Jlog in again"+strings.Repeat("x", 5000)))
	ge.Meta().Set("Set-Cookie", "evil=1")
	err := toConnect(ge)
	var ce *connect.Error
	if !errors.As(err, &ce) {
		t.Fatalf("not a connect error: %v", err)
	}
	if ce.Code() != connect.CodeInternal {
		t.Errorf("code = %v, want internal", ce.Code())
	}
	if strings.ContainsRune(ce.Message(), 0x1b) || len(ce.Message()) > relay.MaxGuestMessage+32 || !strings.HasPrefix(ce.Message(), "guest agent: ") {
		t.Errorf("message not sanitized: %q", ce.Message()[:40])
	}
	if len(ce.Meta()) != 0 {
		t.Errorf("guest metadata passed through: %v", ce.Meta())
	}
	ok := toConnect(connect.NewWireError(connect.CodeNotFound, errors.New(`exec: "foo": executable file not found`)))
	if connect.CodeOf(ok) != connect.CodeNotFound {
		t.Errorf("allowed code changed: %v", ok)
	}
	// Manager sentinels win over any wrapped connect error.
	wrapped := fmt.Errorf("%w: %w", vm.ErrNotRunning, connect.NewError(connect.CodeUnavailable, errors.New("x")))
	if connect.CodeOf(toConnect(wrapped)) != connect.CodeFailedPrecondition {
		t.Errorf("sentinel lost: %v", toConnect(wrapped))
	}
}
