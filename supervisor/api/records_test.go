package api

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/supervisor/driver/drivertest"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

// TestVMRecords: a VM's console and its audit records, to an operator and
// to its own token's holder, and to no other token; GetCaller tells a
// token's holder its VM.
func TestVMRecords(t *testing.T) {
	sock, tokens, drv, _ := authzAPI(t)
	ctx := context.Background()
	op := client.New(sock)
	drv.SetNext(drivertest.Behavior{Console: "booting\nhello from the guest\n"})
	for _, n := range []string{"a", "b"} {
		if _, err := op.VMs.CreateVM(ctx, connect.NewRequest(&apiv1.CreateVMRequest{Name: n, Image: "dev"})); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := op.Stat(ctx, "a", "/etc/shadow"); err == nil {
		t.Fatal("stat /etc/shadow allowed")
	}
	_, secret, err := tokens.Create("a", 0)
	if err != nil {
		t.Fatal(err)
	}
	holder := client.New(sock, client.WithToken(secret))

	for who, c := range map[string]*client.Client{"operator": op, "a's token": holder} {
		waitFor(t, "the console", func() bool {
			resp, err := c.VMs.GetConsole(ctx, connect.NewRequest(&apiv1.GetConsoleRequest{Name: "a"}))
			return err == nil && strings.Contains(string(resp.Msg.Data), "hello from the guest\n") && !resp.Msg.Truncated
		})
		resp, err := c.VMs.GetConsole(ctx, connect.NewRequest(&apiv1.GetConsoleRequest{Name: "a", MaxBytes: 6}))
		if err != nil || string(resp.Msg.Data) != "guest\n" || !resp.Msg.Truncated {
			t.Errorf("%s: the console's last 6 bytes: %v %v", who, resp, err)
		}
		recs, err := c.VMs.ListAuditRecords(ctx, connect.NewRequest(&apiv1.ListAuditRecordsRequest{Name: "a"}))
		if err != nil {
			t.Fatalf("%s: audit records: %v", who, err)
		}
		var kinds []string
		deny := false
		for _, r := range recs.Msg.Records {
			kinds = append(kinds, r.Kind)
			deny = deny || (r.Kind == "policy.decision" && strings.Contains(r.Summary, "carrel.fs.secret_path"))
			if r.Time == "" || r.Provenance != "host" || (r.Session != "" && !strings.HasPrefix(r.Session, "ses_")) {
				t.Errorf("%s: record %+v", who, r)
			}
		}
		if !slices.Contains(kinds, "vm.lifecycle") || !deny || recs.Msg.Partial {
			t.Errorf("%s: a's records: %v, the deny %v, partial %v", who, kinds, deny, recs.Msg.Partial)
		}
		two, err := c.VMs.ListAuditRecords(ctx, connect.NewRequest(&apiv1.ListAuditRecordsRequest{Name: "a", Limit: 2}))
		if err != nil || len(two.Msg.Records) != 2 || two.Msg.Records[1].Seq <= two.Msg.Records[0].Seq {
			t.Errorf("%s: the last 2 records: %v %v", who, two, err)
		}
	}
	if _, err := holder.VMs.GetConsole(ctx, connect.NewRequest(&apiv1.GetConsoleRequest{Name: "b"})); connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Errorf("a's token, b's console: %v", err)
	}
	if _, err := holder.VMs.ListAuditRecords(ctx, connect.NewRequest(&apiv1.ListAuditRecordsRequest{Name: "b"})); connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Errorf("a's token, b's records: %v", err)
	}
	if _, err := op.VMs.GetConsole(ctx, connect.NewRequest(&apiv1.GetConsoleRequest{Name: "nope"})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("console of no vm: %v", err)
	}
	if _, err := op.VMs.ListAuditRecords(ctx, connect.NewRequest(&apiv1.ListAuditRecordsRequest{Name: "nope"})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("records of no vm: %v", err)
	}

	who, err := holder.System.GetCaller(ctx, connect.NewRequest(&apiv1.GetCallerRequest{}))
	if err != nil || who.Msg.Type != "token" || who.Msg.Vm != "a" || !strings.HasPrefix(secret, "carrel_"+who.Msg.TokenId+"_") {
		t.Errorf("GetCaller with a's token: %v %v", who, err)
	}
	who, err = op.System.GetCaller(ctx, connect.NewRequest(&apiv1.GetCallerRequest{}))
	if err != nil || who.Msg.Type != "peer" || who.Msg.Vm != "" {
		t.Errorf("GetCaller as the operator: %v %v", who, err)
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
