package api

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/client"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
	"github.com/carrel-os/carrel/supervisor/identity"
)

// TestExecNamesItsCaller: VMService.Exec, decided when its request
// arrives, still hands its handler the caller: the command's intent (and
// its exec decision) name the token that ran it, not a nameless peer.
func TestExecNamesItsCaller(t *testing.T) {
	sock, tokens, _, _, alog := authzAPIWithAudit(t)
	ctx := context.Background()
	c := client.New(sock)
	if _, err := c.VMs.CreateVM(ctx, connect.NewRequest(&apiv1.CreateVMRequest{Name: "a", Image: "dev"})); err != nil {
		t.Fatal(err)
	}
	tok, secret, err := tokens.Create("a", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	s, err := client.New(sock, client.WithToken(secret)).VMs.Exec(ctx, connect.NewRequest(&apiv1.ExecRequest{Vm: "a", Argv: []string{"echo", "hello"}}))
	if err != nil {
		t.Fatal(err)
	}
	for s.Receive() {
	}
	if err := s.Err(); err != nil {
		t.Fatal(err)
	}
	dir := alog.Dir()
	alog.Close()
	found := false
	for _, r := range readLog(t, dir) {
		if r.Kind != audit.KindIntent {
			continue
		}
		var in audit.ExecIntent
		if err := json.Unmarshal(r.Data, &in); err != nil || in.Action != audit.ActionExec {
			continue
		}
		found = true
		if in.Caller.Type != audit.CallerToken || in.Caller.TokenID != tok.ID {
			t.Errorf("the exec intent's caller %+v, want token %s", in.Caller, tok.ID)
		}
	}
	if !found {
		t.Fatal("no exec intent recorded")
	}
}

// TestHeaderScopesRelayedCallsAlone: a token or key naming its own VM in
// the Carrel-Vm header does not reach carreld's procedures that name no VM
// (listing every VM, every decision); a token lists its own VM alone.
func TestHeaderScopesRelayedCallsAlone(t *testing.T) {
	sock, tokens, _, _ := authzAPI(t)
	ctx := context.Background()
	c := client.New(sock)
	for _, n := range []string{"a", "b"} {
		if _, err := c.VMs.CreateVM(ctx, connect.NewRequest(&apiv1.CreateVMRequest{Name: n, Image: "dev"})); err != nil {
			t.Fatal(err)
		}
	}
	_, secret, _ := tokens.Create("a", time.Hour)
	tc := client.New(sock, client.WithToken(secret))
	req := connect.NewRequest(&apiv1.ListVMsRequest{})
	req.Header().Set(protocol.VMHeader, "a")
	if resp, err := tc.VMs.ListVMs(ctx, req); connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Errorf("a token's ListVMs with its VM in the header: %v %v, want denied", resp, err)
	}
	_, ksecret, err := tokens.CreateKey(identity.Key{Name: "alice", Images: []string{"dev"}}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	kc := client.New(sock, client.WithToken(ksecret))
	r2 := connect.NewRequest(&apiv1.ListDecisionsRequest{})
	r2.Header().Set(protocol.VMHeader, "e2b-alice-00000000")
	if _, err := kc.Policies.ListDecisions(ctx, r2); connect.CodeOf(err) != connect.CodePermissionDenied || !strings.Contains(err.Error(), "carrel.api.key_vm") {
		t.Errorf("a key's ListDecisions with its VM in the header: %v, want denied by carrel.api.key_vm", err)
	}
	// A key lists its own VMs alone.
	resp, err := kc.VMs.ListVMs(ctx, connect.NewRequest(&apiv1.ListVMsRequest{}))
	if err != nil || len(resp.Msg.Vms) != 0 {
		t.Errorf("a key's ListVMs: %v, %v; want none of the operator's", resp, err)
	}
}
