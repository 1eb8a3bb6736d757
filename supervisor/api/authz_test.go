package api

import (
	"context"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/image/store/storetest"
	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/supervisor/driver/drivertest"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
	"github.com/carrel-os/carrel/supervisor/identity"
	"github.com/carrel-os/carrel/supervisor/policystore"
	"github.com/carrel-os/carrel/supervisor/recorder"
	"github.com/carrel-os/carrel/supervisor/registry"
	"github.com/carrel-os/carrel/supervisor/vm"
)

// servedServices are the services Handler serves: carreld's own and the
// agent's, relayed.
func servedServices() []protoreflect.ServiceDescriptor {
	var out []protoreflect.ServiceDescriptor
	for _, f := range []protoreflect.FileDescriptor{
		apiv1.File_carrel_api_v1_api_proto, apiv1.File_carrel_api_v1_policy_proto,
		agentv1.File_carrel_agent_v1_agent_proto, agentv1.File_carrel_agent_v1_files_proto, agentv1.File_carrel_agent_v1_ports_proto,
		// Classified for completeness; carreld does not mount it (TestEgressServiceNotServed).
		agentv1.File_carrel_agent_v1_egress_proto,
	} {
		for i := 0; i < f.Services().Len(); i++ {
			out = append(out, f.Services().Get(i))
		}
	}
	return out
}

// TestEveryRPCHasAPolicyRule enumerates every RPC carreld serves and
// proves each built-in policy classifies it, and that the classification
// names no RPC that does not exist: no RPC can be added without a rule.
func TestEveryRPCHasAPolicyRule(t *testing.T) {
	served := map[string]bool{}
	for _, s := range servedServices() {
		for i := 0; i < s.Methods().Len(); i++ {
			served["/"+string(s.FullName())+"/"+string(s.Methods().Get(i).Name())] = true
		}
	}
	if len(served) < 30 {
		t.Fatalf("only %d procedures found; the descriptor list is wrong", len(served))
	}
	ctx := context.Background()
	for _, name := range policy.BuiltinNames() {
		b, err := policy.Builtin(name)
		if err != nil {
			t.Fatal(err)
		}
		p, err := policy.Compile(ctx, name, b)
		if err != nil {
			t.Fatal(err)
		}
		procs, err := p.Procedures(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for proc := range served {
			if procs[proc] == "" {
				t.Errorf("policy %s: %s has no class in carrel.api.procedures", name, proc)
			}
		}
		for proc := range procs {
			if !served[proc] {
				t.Errorf("policy %s: carrel.api.procedures names %s, which carreld does not serve", name, proc)
			}
		}
	}
}

// authzAPI serves the API with the real policy store and token file, over
// a unix socket (so SO_PEERCRED is real), on a fake driver.
func authzAPI(t *testing.T) (string, *identity.Tokens, *drivertest.Driver, *policystore.Store) {
	sock, tokens, drv, pols, _ := authzAPIWithAudit(t)
	return sock, tokens, drv, pols
}

// authzAPIWithAudit is authzAPI with a real audit log, which it returns.
func authzAPIWithAudit(t *testing.T) (string, *identity.Tokens, *drivertest.Driver, *policystore.Store, *audit.Log) {
	t.Helper()
	dir := t.TempDir()
	img, _ := storetest.WithFakeImage(t, dir, "dev")
	reg, _ := registry.Open(filepath.Join(dir, "vms"))
	drv := drivertest.New()
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
	// Recorded as carreld records them.
	rec := recorder.New(alog, nil)
	pols.Record = rec.Decision
	m := vm.New(vm.Config{Registry: reg, Images: img, Driver: drv, BootTimeout: 2 * time.Second,
		Policies: pols,
		OnEvent:  rec.Lifecycle(pols, nil),
	})
	t.Cleanup(func() { m.Close() })
	sock := filepath.Join(dir, "api.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	sctx, cancel := context.WithCancel(ctx)
	done := make(chan error)
	h := Handler(Config{Manager: m, Images: img, Policies: pols, Tokens: tokens, DaemonUID: uint32(os.Getuid()), Recorder: rec, AuditDir: alog.Dir()})
	go func() { done <- Serve(sctx, l, h) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return sock, tokens, drv, pols, alog
}

// TestExecIsRecorded: a command's intent is durable before it starts, and
// its outcome follows, tied to it.
func TestExecIsRecorded(t *testing.T) {
	sock, _, _, _, alog := authzAPIWithAudit(t)
	ctx := context.Background()
	c := client.New(sock)
	if _, err := c.VMs.CreateVM(ctx, connect.NewRequest(&apiv1.CreateVMRequest{Name: "a", Image: "dev"})); err != nil {
		t.Fatal(err)
	}
	s, err := c.VMs.Exec(ctx, connect.NewRequest(&apiv1.ExecRequest{Vm: "a", Argv: []string{"echo", "hello"}}))
	if err != nil {
		t.Fatal(err)
	}
	for s.Receive() {
	}
	if err := s.Err(); err != nil {
		t.Fatal(err)
	}
	// An attempt on a stopped VM is decided and on record too, with the
	// error its client got.
	if _, err := c.VMs.StopVM(ctx, connect.NewRequest(&apiv1.StopVMRequest{Name: "a", Force: true})); err != nil {
		t.Fatal(err)
	}
	s, err = c.VMs.Exec(ctx, connect.NewRequest(&apiv1.ExecRequest{Vm: "a", Argv: []string{"echo", "again"}}))
	if err == nil {
		for s.Receive() {
		}
		err = s.Err()
	}
	if connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("exec on a stopped vm: %v", err)
	}
	dir := alog.Dir()
	alog.Close()
	var intents, outcomes []audit.Record
	if err := audit.Scan(dir, func(_ uint64, _ int64, payload []byte) error {
		r, err := audit.Decode(payload)
		if err != nil {
			return err
		}
		switch r.Kind {
		case audit.KindIntent:
			intents = append(intents, r)
		case audit.KindExecExit:
			outcomes = append(outcomes, r)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if len(intents) != 2 || len(outcomes) != 2 {
		t.Fatalf("exec records: intents %v, outcomes %v", intents, outcomes)
	}
	intent, outcome := &intents[0], &outcomes[0]
	if x := outcomes[1]; *x.Intent != intents[1].Seq || !strings.Contains(string(x.Data), `"error":`) || !strings.Contains(string(x.Data), "stopped") {
		t.Errorf("outcome on a stopped vm: %s", x.Data)
	}
	if !strings.Contains(string(intent.Data), `"action":"exec"`) || !strings.Contains(string(intent.Data), `"argv":["echo","hello"]`) || !strings.Contains(string(intent.Data), `"user":"agent"`) || intent.VM != "a" {
		t.Errorf("intent: %s", intent.Data)
	}
	if outcome.Intent == nil || *outcome.Intent != intent.Seq || !strings.Contains(string(outcome.Data), `"code":0`) || !strings.Contains(string(outcome.Data), `"stdout_bytes":11`) {
		t.Errorf("outcome: %+v %s", outcome, outcome.Data)
	}
	rep, err := audit.Verify(dir, audit.VerifyOptions{})
	if err != nil || len(rep.Problems) > 0 {
		t.Errorf("verify: %v %+v", err, rep)
	}
}

func wantDenied(t *testing.T, what string, err error, rule string) {
	t.Helper()
	if connect.CodeOf(err) != connect.CodePermissionDenied || !strings.Contains(err.Error(), rule) {
		t.Errorf("%s: %v, want PermissionDenied naming %s", what, err, rule)
	}
}

func TestAuthorization(t *testing.T) {
	sock, tokens, drv, pols := authzAPI(t)
	ctx := context.Background()
	op := client.New(sock) // this test's own uid: carreld's, so an operator
	for _, n := range []string{"a", "b"} {
		if _, err := op.VMs.CreateVM(ctx, connect.NewRequest(&apiv1.CreateVMRequest{Name: n, Image: "dev"})); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := op.VMs.CreateVM(ctx, connect.NewRequest(&apiv1.CreateVMRequest{Name: "c", Image: "dev", Policy: "nope"})); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("create with an unknown policy: %v", err)
	}

	// Booting gave the guest its policy's sandbox.
	sb := drv.VM(1001).Sandbox()
	if sb == nil || !strings.Contains(strings.Join(sb.ReadWrite, " "), "/workspace") || sb.Revision == "" {
		t.Errorf("sandbox given at boot: %v", sb)
	}

	// Operation decisions, with the default policy.
	_, err := op.Stat(ctx, "a", "/etc/shadow")
	wantDenied(t, "stat /etc/shadow", err, "carrel.fs.secret_path")
	_, err = op.Stat(ctx, "a", "/workspace/../root/x")
	wantDenied(t, "stat through ..", err, "carrel.fs")
	if _, err := op.Stat(ctx, "a", "relative"); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("relative path: %v", err)
	}
	s, err := op.Agent.Exec(ctx, forVM("a", &agentv1.ExecRequest{Argv: []string{"id"}, User: "root"}))
	if err == nil {
		for s.Receive() {
			t.Errorf("exec as root relayed: %v", s.Msg())
		}
		err = s.Err()
	}
	wantDenied(t, "exec as root", err, "carrel.exec")
	s, err = op.Agent.Exec(ctx, forVM("a", &agentv1.ExecRequest{Argv: []string{"echo", "hi"}}))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for s.Receive() {
		n++
	}
	if s.Err() != nil || n == 0 {
		t.Errorf("exec as agent: %d events, %v", n, s.Err())
	}

	// A token scoped to VM a.
	_, secret, err := tokens.Create("a", 0)
	if err != nil {
		t.Fatal(err)
	}
	tc := client.New(sock, client.WithToken(secret))
	if _, err := tc.VMs.GetVM(ctx, connect.NewRequest(&apiv1.GetVMRequest{Name: "a"})); err != nil {
		t.Errorf("token on its vm: %v", err)
	}
	_, err = tc.VMs.GetVM(ctx, connect.NewRequest(&apiv1.GetVMRequest{Name: "b"}))
	wantDenied(t, "token on another vm", err, "carrel.api.token_vm")
	_, err = tc.VMs.ListVMs(ctx, connect.NewRequest(&apiv1.ListVMsRequest{}))
	wantDenied(t, "token listing every vm", err, "carrel.api.token_vm")
	_, err = tc.VMs.DeleteVM(ctx, connect.NewRequest(&apiv1.DeleteVMRequest{Name: "a", Force: true}))
	wantDenied(t, "token deleting its vm", err, "carrel.api.token_class")
	_, err = tc.Tokens.CreateToken(ctx, connect.NewRequest(&apiv1.CreateTokenRequest{Vm: "a"}))
	wantDenied(t, "token minting tokens", err, "carrel.api.token_class")
	if _, err := tc.Stat(ctx, "b", "/workspace"); connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Errorf("token relaying to another vm: %v", err)
	}
	// Streams are decided before the guest is reached.
	ws := tc.Files.Write(ctx)
	ws.RequestHeader().Set(protocol.VMHeader, "b")
	ws.Send(&agentv1.WriteRequest{Msg: &agentv1.WriteRequest_Header{Header: &agentv1.WriteHeader{Path: "/workspace/x"}}})
	_, err = ws.CloseAndReceive()
	wantDenied(t, "token writing to another vm", err, "carrel.api.token_vm")
	es, err := tc.VMs.Exec(ctx, connect.NewRequest(&apiv1.ExecRequest{Vm: "b", Argv: []string{"true"}}))
	if err == nil {
		for es.Receive() {
			t.Errorf("exec on another vm relayed: %v", es.Msg())
		}
		err = es.Err()
	}
	wantDenied(t, "token exec on another vm", err, "carrel.api.token_vm")

	bad := client.New(sock, client.WithToken(strings.Replace(secret, secret[len(secret)-4:], "0000", 1)))
	if _, err := bad.VMs.GetVM(ctx, connect.NewRequest(&apiv1.GetVMRequest{Name: "a"})); connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Errorf("a wrong secret: %v", err)
	}

	// Every decision was recorded, denies with their rule.
	var denies int
	for _, d := range pols.Recent("", 1000, true) {
		if d.Rule == "" || d.ID == "" || d.Revision == "" {
			t.Errorf("decision without rule, id or revision: %+v", d)
		}
		denies++
	}
	if denies < 8 {
		t.Errorf("%d denies recorded, want at least 8", denies)
	}
}

// TestApplyPolicy replaces a VM's policy while it runs: the new bundle is
// checked first, a bad one changes nothing, and the guest gets the new
// sandbox.
func TestApplyPolicy(t *testing.T) {
	sock, _, drv, _ := authzAPI(t)
	ctx := context.Background()
	c := client.New(sock)
	if _, err := c.VMs.CreateVM(ctx, connect.NewRequest(&apiv1.CreateVMRequest{Name: "a", Image: "dev"})); err != nil {
		t.Fatal(err)
	}
	def, err := policy.Builtin(policy.DefaultName)
	if err != nil {
		t.Fatal(err)
	}
	files := map[string][]byte{}
	for p, b := range def.Files {
		files[p] = b
	}
	// A bundle whose rules do not compile is refused.
	broken := map[string][]byte{"fs.rego": []byte("package carrel.fs\ndecision := {")}
	for p, b := range files {
		if p != "fs.rego" {
			broken[p] = b
		}
	}
	if _, err := c.Policies.ApplyPolicy(ctx, connect.NewRequest(&apiv1.ApplyPolicyRequest{Name: "custom", Files: broken, Vms: []string{"a"}})); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("broken bundle: %v", err)
	}
	if v, _ := c.VMs.GetVM(ctx, connect.NewRequest(&apiv1.GetVMRequest{Name: "a"})); v.Msg.Vm.Policy != "default" {
		t.Errorf("after a refused apply the vm's policy is %q", v.Msg.Vm.Policy)
	}
	// Data only, on the default rules: /srv writable too. Its own test
	// proves the change.
	data := strings.Replace(string(files["data.json"]), `"/workspace",`, `"/workspace", "/srv",`, 1)
	if data == string(files["data.json"]) {
		t.Fatal("data.json has no read_write list starting with /workspace")
	}
	custom := map[string][]byte{"data.json": []byte(data), "srv_test.rego": []byte(`package carrel.srv_test

test_srv_writable if {
	data.carrel.fs.decision.allow with input as {"version": 1, "vm": "a", "operation": "write", "path": "/srv/x", "recursive": false, "caller": {"type": "peer", "uid": 0}}
}
`)}
	resp, err := c.Policies.ApplyPolicy(ctx, connect.NewRequest(&apiv1.ApplyPolicyRequest{Name: "custom", Files: custom, Vms: []string{"a"}}))
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Msg.Tests) != 1 || !resp.Msg.Tests[0].Pass {
		t.Errorf("tests: %v", resp.Msg.Tests)
	}
	sb := drv.VM(1001).Sandbox()
	if sb == nil || !strings.Contains(strings.Join(sb.ReadWrite, " "), "/srv") || sb.Revision != resp.Msg.Policy.Revision {
		t.Errorf("guest sandbox after apply: %v (policy %v)", sb, resp.Msg.Policy)
	}
	// The fake guest has no file service: reaching it means the policy
	// allowed the call.
	if _, err := c.Stat(ctx, "a", "/srv/x"); connect.CodeOf(err) == connect.CodePermissionDenied {
		t.Errorf("stat /srv/x under the new policy: %v", err)
	}
	// A failing test refuses the bundle; the applied one keeps serving.
	custom["srv_test.rego"] = []byte("package carrel.srv_test\n\ntest_fails if {\n\tfalse\n}\n")
	_, err = c.Policies.ApplyPolicy(ctx, connect.NewRequest(&apiv1.ApplyPolicyRequest{Name: "custom", Files: custom}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "tests failed") {
		t.Errorf("bundle with a failing test: %v", err)
	}
	if _, err := c.Stat(ctx, "a", "/srv/x"); connect.CodeOf(err) == connect.CodePermissionDenied {
		t.Errorf("after a refused apply the old policy must keep serving: %v", err)
	}
}

// TestEgressServiceNotServed: the guest's EgressService is carreld's own
// business; its API does not serve it, even to an operator.
func TestEgressServiceNotServed(t *testing.T) {
	sock, _, _, _ := authzAPI(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	p := new(http.Protocols)
	p.SetUnencryptedHTTP2(true)
	hc := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		},
		Protocols: p,
	}}
	c := agentv1connect.NewEgressServiceClient(hc, "http://carreld", connect.WithGRPC())
	req := connect.NewRequest(&agentv1.EgressRequestsRequest{})
	req.Header().Set(protocol.VMHeader, "a")
	s, err := c.Requests(ctx, req)
	if err == nil {
		for s.Receive() {
			t.Errorf("EgressService/Requests answered: %v", s.Msg())
		}
		err = s.Err()
	}
	if connect.CodeOf(err) != connect.CodeUnimplemented {
		t.Errorf("EgressService/Requests on carreld's API: %v; want unimplemented", err)
	}
	bs := c.Connect(ctx)
	bs.RequestHeader().Set(protocol.VMHeader, "a")
	bs.Send(&agentv1.EgressData{Msg: &agentv1.EgressData_Verdict{Verdict: &agentv1.EgressVerdict{Id: 1, Outcome: agentv1.EgressOutcome_EGRESS_OUTCOME_ALLOWED}}})
	bs.CloseRequest()
	if _, err := bs.Receive(); connect.CodeOf(err) != connect.CodeUnimplemented {
		t.Errorf("EgressService/Connect on carreld's API: %v; want unimplemented", err)
	}
}
