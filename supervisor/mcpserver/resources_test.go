package mcpserver

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/carrel-os/carrel/image/store/storetest"
	"github.com/carrel-os/carrel/supervisor/api"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/supervisor/driver/drivertest"
	"github.com/carrel-os/carrel/supervisor/gen/apiv1"
	"github.com/carrel-os/carrel/supervisor/identity"
	"github.com/carrel-os/carrel/supervisor/policystore"
	"github.com/carrel-os/carrel/supervisor/recorder"
	"github.com/carrel-os/carrel/supervisor/registry"
	"github.com/carrel-os/carrel/supervisor/vm"
)

// carreldAPI serves carreld's real API (policy, tokens, audit log) over a
// unix socket, on a fake driver, with VMs a and b, whose consoles say
// hello in colour. It returns the socket and the token store.
func carreldAPI(t *testing.T) (string, *identity.Tokens) {
	t.Helper()
	dir := t.TempDir()
	img, _ := storetest.WithFakeImage(t, dir, "dev")
	reg, err := registry.Open(filepath.Join(dir, "vms"))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	pols, err := policystore.Open(ctx, filepath.Join(dir, "policies"), nil)
	if err != nil {
		t.Fatal(err)
	}
	tokens, err := identity.OpenTokens(filepath.Join(dir, "tokens.json"))
	if err != nil {
		t.Fatal(err)
	}
	alog, err := audit.Open(filepath.Join(dir, "audit"), audit.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { alog.Close() })
	rec := recorder.New(alog, nil)
	pols.Record = rec.Decision
	drv := drivertest.New()
	m := vm.New(vm.Config{Registry: reg, Images: img, Driver: drv, BootTimeout: 2 * time.Second, Policies: pols, OnEvent: rec.Lifecycle(pols, nil)})
	t.Cleanup(func() { m.Close() })
	sock := filepath.Join(dir, "api.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	sctx, cancel := context.WithCancel(ctx)
	done := make(chan error)
	h := api.Handler(api.Config{Manager: m, Images: img, Policies: pols, Tokens: tokens, DaemonUID: uint32(os.Getuid()), Recorder: rec, AuditDir: alog.Dir()})
	go func() { done <- api.Serve(sctx, l, h) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	op := client.New(sock)
	for _, n := range []string{"a", "b"} {
		drv.SetNext(drivertest.Behavior{Console: "booting\n\x1b[32mhello from the guest\x1b[0m\r\n"})
		if _, err := op.VMs.CreateVM(ctx, connect.NewRequest(&apiv1.CreateVMRequest{Name: n, Image: "dev"})); err != nil {
			t.Fatal(err)
		}
	}
	return sock, tokens
}

// session connects an MCP client to New(c, cfg), in memory.
func session(t *testing.T, c *client.Client, cfg Config) *mcp.ClientSession {
	t.Helper()
	st, ct := mcp.NewInMemoryTransports()
	ctx := context.Background()
	ss, err := New(c, cfg).Connect(ctx, st, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ss.Close() })
	cs, err := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "v0"}, nil).Connect(ctx, ct, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cs.Close() })
	return cs
}

// read reads a resource's text, or returns its error.
func read(s *mcp.ClientSession, uri string) (string, error) {
	res, err := s.ReadResource(context.Background(), &mcp.ReadResourceParams{URI: uri})
	if err != nil {
		return "", err
	}
	if len(res.Contents) != 1 || res.Contents[0].URI != uri || res.Contents[0].MIMEType != "text/plain" {
		return "", &os.PathError{Op: "read", Path: uri, Err: os.ErrInvalid}
	}
	return res.Contents[0].Text, nil
}

// TestResources: a VM's audit timeline and console as resources, listed
// by a server scoped to the VM and offered as templates by one that is
// not; the VM's policy decides them as it does the tools.
func TestResources(t *testing.T) {
	sock, tokens := carreldAPI(t)
	ctx := context.Background()
	op := client.New(sock)
	scoped := session(t, op, Config{VM: "a"})

	// Something to find in the timeline: a read the policy denies.
	res, err := scoped.CallTool(ctx, &mcp.CallToolParams{Name: "read_file", Arguments: map[string]any{"path": "/etc/shadow"}})
	if err != nil || !res.IsError {
		t.Fatalf("read /etc/shadow: %v %v", res, err)
	}

	list, err := scoped.ListResources(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	var uris []string
	for _, r := range list.Resources {
		uris = append(uris, r.URI)
		if r.MIMEType != "text/plain" || r.Description == "" {
			t.Errorf("resource %+v", r)
		}
	}
	if strings.Join(uris, " ") != "carrel://vm/a/audit carrel://vm/a/console" {
		t.Errorf("a scoped server lists %v", uris)
	}
	if tl, err := scoped.ListResourceTemplates(ctx, nil); err != nil || len(tl.ResourceTemplates) != 0 {
		t.Errorf("a scoped server's templates: %v %v", tl, err)
	}

	timeline, err := read(scoped, "carrel://vm/a/audit")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSuffix(timeline, "\n"), "\n")
	if !strings.HasPrefix(lines[0], "TIME (UTC)") || len(lines) < 4 {
		t.Fatalf("timeline:\n%s", timeline)
	}
	deny := false
	for _, l := range lines[1:] {
		deny = deny || (strings.Contains(l, "policy.decision") && strings.Contains(l, "deny fs") && strings.Contains(l, "carrel.fs.secret_path"))
	}
	if !deny || !strings.Contains(timeline, "vm.lifecycle") {
		t.Errorf("the timeline lacks the denied read or the VM's start:\n%s", timeline)
	}
	waitFor(t, "the console resource", func() bool {
		text, err := read(scoped, "carrel://vm/a/console")
		return err == nil && strings.Contains(text, "booting\nhello from the guest\n")
	})
	if text, _ := read(scoped, "carrel://vm/a/console"); strings.ContainsAny(text, "\x1b\r") {
		t.Errorf("control characters from the guest: %q", text)
	}
	for _, uri := range []string{"carrel://vm/b/audit", "carrel://vm/b/console", "carrel://vm/a/nope", "carrel://vm/a/audit?x=1"} {
		if _, err := read(scoped, uri); err == nil || !strings.Contains(err.Error(), "not found") {
			t.Errorf("a scoped server reads %s: %v", uri, err)
		}
	}

	open := session(t, op, Config{})
	if l, err := open.ListResources(ctx, nil); err != nil || len(l.Resources) != 0 {
		t.Errorf("an unscoped server lists %v %v", l, err)
	}
	tl, err := open.ListResourceTemplates(ctx, nil)
	if err != nil || len(tl.ResourceTemplates) != 2 || tl.ResourceTemplates[0].URITemplate != "carrel://vm/{name}/audit" || tl.ResourceTemplates[1].URITemplate != "carrel://vm/{name}/console" {
		t.Errorf("an unscoped server's templates: %v %v", tl, err)
	}
	if text, err := read(open, "carrel://vm/b/console"); err != nil || !strings.Contains(text, "booting") {
		t.Errorf("b's console: %q %v", text, err)
	}
	for _, uri := range []string{"carrel://vm/nope/console", "carrel://vm/Not_A_Name/audit", "carrel://vm/a/b/audit"} {
		if _, err := read(open, uri); err == nil || !strings.Contains(err.Error(), "not found") {
			t.Errorf("an unscoped server reads %s: %v", uri, err)
		}
	}

	// As a's token's holder: a's resources, not b's.
	_, secret, err := tokens.Create("a", 0)
	if err != nil {
		t.Fatal(err)
	}
	holder := session(t, client.New(sock, client.WithToken(secret)), Config{})
	if text, err := read(holder, "carrel://vm/a/audit"); err != nil || !strings.Contains(text, "carrel.fs.secret_path") {
		t.Errorf("a's token, a's timeline: %v", err)
	}
	if _, err := read(holder, "carrel://vm/b/audit"); err == nil || !strings.Contains(err.Error(), "carrel.api.token_vm") {
		t.Errorf("a's token, b's timeline: %v", err)
	}
}

// waitFor polls cond for up to 5 seconds.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !cond(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}
