package api

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/client"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
	"github.com/carrel-os/carrel/supervisor/identity"
	"github.com/carrel-os/carrel/supervisor/vm"
)

// keyClient issues key alice, of image dev and limits lim, and returns a
// client that calls as it.
func keyClient(t *testing.T, sock string, tokens *identity.Tokens, lim identity.Limits) *client.Client {
	t.Helper()
	_, secret, err := tokens.CreateKey(identity.Key{Name: "alice", Images: []string{"dev"}, Limits: lim}, 0)
	if err != nil {
		t.Fatal(err)
	}
	return client.New(sock, client.WithToken(secret))
}

func createAs(c *client.Client, req *apiv1.CreateVMRequest) error {
	if req.Image == "" {
		req.Image = "dev"
	}
	_, err := c.VMs.CreateVM(context.Background(), connect.NewRequest(req))
	return err
}

// wantExhausted checks that err is a quota refusal that names flag.
func wantExhausted(t *testing.T, what string, err error, flag string) {
	t.Helper()
	if connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), flag) || !strings.Contains(err.Error(), "key alice") {
		t.Errorf("%s: %v, want resource exhausted naming key alice and %s", what, err, flag)
	}
}

// TestKeyMaxVMs: a key has at most its limit of VMs, stopped ones
// counted; deleting one makes room. The refusal is on record, naming the
// key and the limit. An operator is not held to a key's limits.
func TestKeyMaxVMs(t *testing.T) {
	sock, tokens, _, _, alog := authzAPIWithAudit(t)
	ctx := context.Background()
	kc := keyClient(t, sock, tokens, identity.Limits{VMs: 2})
	for _, n := range []string{"e2b-alice-1", "e2b-alice-2"} {
		if err := createAs(kc, &apiv1.CreateVMRequest{Name: n}); err != nil {
			t.Fatal(err)
		}
	}
	err := createAs(kc, &apiv1.CreateVMRequest{Name: "e2b-alice-3"})
	wantExhausted(t, "a third VM", err, "--max-vms")
	if !strings.Contains(err.Error(), "limit of 2 VMs (2 exist") || !strings.Contains(err.Error(), "delete a VM") {
		t.Errorf("the refusal %q does not say the limit, the usage and what to do", err)
	}
	if _, err := kc.VMs.StopVM(ctx, connect.NewRequest(&apiv1.StopVMRequest{Name: "e2b-alice-1"})); err != nil {
		t.Fatal(err)
	}
	wantExhausted(t, "a third VM, one stopped", createAs(kc, &apiv1.CreateVMRequest{Name: "e2b-alice-3"}), "--max-vms")
	if _, err := kc.VMs.DeleteVM(ctx, connect.NewRequest(&apiv1.DeleteVMRequest{Name: "e2b-alice-1"})); err != nil {
		t.Fatal(err)
	}
	if err := createAs(kc, &apiv1.CreateVMRequest{Name: "e2b-alice-3"}); err != nil {
		t.Errorf("a VM after one was deleted: %v", err)
	}
	// Another key's limits, and the operator's VMs, are their own.
	if err := createAs(client.New(sock), &apiv1.CreateVMRequest{Name: "op"}); err != nil {
		t.Errorf("the operator: %v", err)
	}

	dir := alog.Dir()
	alog.Close()
	var refused []audit.APICall
	for _, r := range readLog(t, dir) {
		var c audit.APICall
		if r.Kind != audit.KindAPICall || json.Unmarshal(r.Data, &c) != nil || c.Quota == nil {
			continue
		}
		refused = append(refused, c)
		if r.VM != "e2b-alice-3" {
			t.Errorf("the refusal is recorded for VM %q", r.VM)
		}
	}
	if len(refused) != 2 {
		t.Fatalf("%d api.call records name a quota, want the 2 refusals", len(refused))
	}
	c := refused[0]
	if want := (audit.Quota{Limit: "vms", Max: 2, Used: 2, Asked: 1}); *c.Quota != want {
		t.Errorf("recorded quota %+v, want %+v", *c.Quota, want)
	}
	if c.Code != connect.CodeResourceExhausted.String() || c.Caller == nil || c.Caller.Type != audit.CallerKey || c.Caller.Name != "alice" || !strings.Contains(c.Error, "--max-vms") {
		t.Errorf("recorded call %+v, want resource_exhausted by key alice", c)
	}
}

// TestKeyMaxMemory: a key's VMs' memory, summed, stays within its limit.
func TestKeyMaxMemory(t *testing.T) {
	sock, tokens, _, _ := authzAPI(t)
	kc := keyClient(t, sock, tokens, identity.Limits{MemoryBytes: 1 << 30})
	if err := createAs(kc, &apiv1.CreateVMRequest{Name: "e2b-alice-1"}); err != nil { // 512 MiB by default
		t.Fatal(err)
	}
	err := createAs(kc, &apiv1.CreateVMRequest{Name: "e2b-alice-2", MemoryBytes: 768 << 20})
	wantExhausted(t, "768 MiB more", err, "--max-memory")
	if err != nil && !strings.Contains(err.Error(), "1024 MiB of memory together: they have 512 MiB, and this VM would add 768 MiB") {
		t.Errorf("the refusal %q does not say the limit and the usage", err)
	}
	if err := createAs(kc, &apiv1.CreateVMRequest{Name: "e2b-alice-2", MemoryBytes: 512 << 20}); err != nil {
		t.Errorf("512 MiB more, to the limit: %v", err)
	}
}

// TestKeyMaxDisk: a key's VMs' disks, as created (writable layer and
// workspace), stay within its limit; an ephemeral VM has no writable
// layer on disk.
func TestKeyMaxDisk(t *testing.T) {
	sock, tokens, _, _ := authzAPI(t)
	def := vm.CreateParams{}.Footprint().DiskBytes
	if def != vm.DefaultStateBytes+256<<20 {
		t.Fatalf("a default VM's disk is %d MiB, want 8 GiB and half of 512 MiB", def>>20)
	}
	kc := keyClient(t, sock, tokens, identity.Limits{DiskBytes: def + 2<<30})
	if err := createAs(kc, &apiv1.CreateVMRequest{Name: "e2b-alice-1"}); err != nil {
		t.Fatal(err)
	}
	wantExhausted(t, "a 2 GiB disk more", createAs(kc, &apiv1.CreateVMRequest{Name: "e2b-alice-2", DiskBytes: 2 << 30}), "--max-disk")
	if err := createAs(kc, &apiv1.CreateVMRequest{Name: "e2b-alice-2", Ephemeral: true, WorkspaceBytes: 2 << 30}); err != nil {
		t.Errorf("an ephemeral VM of a 2 GiB workspace, to the limit: %v", err)
	}
	wantExhausted(t, "any VM more", createAs(kc, &apiv1.CreateVMRequest{Name: "e2b-alice-3", Ephemeral: true, WorkspaceBytes: 64 << 20}), "--max-disk")
}

// TestKeyMaxSnapshots: a key's VMs have at most its limit of snapshots
// together; deleting one makes room.
func TestKeyMaxSnapshots(t *testing.T) {
	sock, tokens, _, _ := authzAPI(t)
	ctx := context.Background()
	kc := keyClient(t, sock, tokens, identity.Limits{Snapshots: 2})
	for _, n := range []string{"e2b-alice-1", "e2b-alice-2"} {
		if err := createAs(kc, &apiv1.CreateVMRequest{Name: n}); err != nil {
			t.Fatal(err)
		}
	}
	snap := func(vm, name string) error {
		_, err := kc.VMs.SnapshotVM(ctx, connect.NewRequest(&apiv1.SnapshotVMRequest{Name: vm, Snapshot: name}))
		return err
	}
	if err := snap("e2b-alice-1", "s1"); err != nil {
		t.Fatal(err)
	}
	if err := snap("e2b-alice-2", "s1"); err != nil {
		t.Fatal(err)
	}
	err := snap("e2b-alice-1", "s2")
	wantExhausted(t, "a third snapshot", err, "--max-snapshots")
	if err != nil && !strings.Contains(err.Error(), "limit of 2 snapshots (its VMs have 2)") {
		t.Errorf("the refusal %q does not say the limit and the usage", err)
	}
	if _, err := kc.VMs.DeleteSnapshot(ctx, connect.NewRequest(&apiv1.DeleteSnapshotRequest{Name: "e2b-alice-2", Snapshot: "s1"})); err != nil {
		t.Fatal(err)
	}
	if err := snap("e2b-alice-1", "s2"); err != nil {
		t.Errorf("a snapshot after one was deleted: %v", err)
	}
}

// TestKeyQuotaRace: creates in flight together cannot both take a key's
// last slot: of 8 at once under a limit of 3, exactly 3 are made.
func TestKeyQuotaRace(t *testing.T) {
	sock, tokens, _, _ := authzAPI(t)
	kc := keyClient(t, sock, tokens, identity.Limits{VMs: 3})
	const n = 8
	errs := make([]error, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			errs[i] = createAs(kc, &apiv1.CreateVMRequest{Name: fmt.Sprintf("e2b-alice-%d", i)})
		}()
	}
	close(start)
	wg.Wait()
	made := 0
	for i, err := range errs {
		switch {
		case err == nil:
			made++
		case connect.CodeOf(err) != connect.CodeResourceExhausted:
			t.Errorf("create %d: %v, want made or resource exhausted", i, err)
		}
	}
	if made != 3 {
		t.Errorf("%d of %d creates made a VM, want 3", made, n)
	}
	resp, err := kc.VMs.ListVMs(context.Background(), connect.NewRequest(&apiv1.ListVMsRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Msg.Vms) != 3 {
		t.Errorf("the key lists %d VMs, want 3", len(resp.Msg.Vms))
	}
}

// TestKeyLimitsThroughTheAPI: CreateToken issues a key with its limits,
// ListTokens shows them, and a VM token, which creates no VMs, takes none.
func TestKeyLimitsThroughTheAPI(t *testing.T) {
	sock, tokens, _, _ := authzAPI(t)
	ctx := context.Background()
	c := client.New(sock)
	lim := &apiv1.KeyLimits{Vms: 2, Snapshots: 3, MemoryBytes: 4 << 30, DiskBytes: 50 << 30}
	if _, err := c.Tokens.CreateToken(ctx, connect.NewRequest(&apiv1.CreateTokenRequest{KeyName: "alice", Images: []string{"dev"}, Limits: lim})); err != nil {
		t.Fatal(err)
	}
	resp, err := c.Tokens.ListTokens(ctx, connect.NewRequest(&apiv1.ListTokensRequest{}))
	if err != nil || len(resp.Msg.Tokens) != 1 {
		t.Fatalf("list: %v, %v", resp, err)
	}
	got := resp.Msg.Tokens[0].Limits
	if got.GetVms() != 2 || got.GetSnapshots() != 3 || got.GetMemoryBytes() != 4<<30 || got.GetDiskBytes() != 50<<30 {
		t.Errorf("listed limits %v, want %v", got, lim)
	}
	if l, ok := tokens.LimitsOf(resp.Msg.Tokens[0].Id); !ok || l.VMs != 2 {
		t.Errorf("stored limits %+v, %v", l, ok)
	}
	// Another key of the name must give the same.
	if _, err := c.Tokens.CreateToken(ctx, connect.NewRequest(&apiv1.CreateTokenRequest{KeyName: "alice", Images: []string{"dev"}})); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("a second alice key without limits: %v, want invalid argument", err)
	}
	if err := createAs(c, &apiv1.CreateVMRequest{Name: "a"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Tokens.CreateToken(ctx, connect.NewRequest(&apiv1.CreateTokenRequest{Vm: "a", Limits: &apiv1.KeyLimits{Vms: 1}})); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("a VM token with limits: %v, want invalid argument", err)
	}
}
