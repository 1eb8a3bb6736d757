package api

import (
	"context"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/image/store/storetest"
	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/supervisor/driver/drivertest"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
	"github.com/carrel-os/carrel/supervisor/gpu"
	"github.com/carrel-os/carrel/supervisor/gpu/gputest"
	"github.com/carrel-os/carrel/supervisor/identity"
	"github.com/carrel-os/carrel/supervisor/policystore"
	"github.com/carrel-os/carrel/supervisor/recorder"
	"github.com/carrel-os/carrel/supervisor/registry"
	"github.com/carrel-os/carrel/supervisor/vm"
)

type gpuEnv struct {
	sock   string
	drv    *drivertest.Driver
	pols   *policystore.Store
	alog   *audit.Log
	tokens *identity.Tokens
}

// gpuAPI serves the API as carreld wires it, on a fake driver and a fake
// sysfs tree holding an assignable NVIDIA card, an AMD card sharing its
// IOMMU group with a NIC, and an integrated Intel GPU.
func gpuAPI(t *testing.T) gpuEnv {
	t.Helper()
	t.Log("fake sysfs tree and fake driver: real VFIO passthrough is not exercised here")
	s := gputest.New(t, gputest.Drivers...)
	s.Add(gputest.NVIDIAWithAudio()...)
	s.Add(gputest.AMDSharingNIC()...)
	s.Add(gputest.IntelIntegrated()...)
	gpus := gpu.New(gpu.Config{Sysfs: s.Root, Write: s.Write, PCIIDs: []string{gputest.PCIIDs(t)}})

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
	rec := recorder.New(alog, nil)
	pols.Record = rec.Decision
	m := vm.New(vm.Config{Registry: reg, Images: img, Driver: drv, BootTimeout: 2 * time.Second,
		Policies: pols,
		OnEvent:  rec.Lifecycle(pols, nil),
		CheckGPUs: func(want []string, held map[string][]string) error {
			_, err := gpus.Check(want, held)
			return err
		},
	})
	t.Cleanup(func() { m.Close() })
	sock := filepath.Join(dir, "api.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	sctx, cancel := context.WithCancel(ctx)
	done := make(chan error)
	h := Handler(Config{Manager: m, Images: img, Policies: pols, Tokens: tokens, DaemonUID: uint32(os.Getuid()), Recorder: rec, GPUs: gpus})
	go func() { done <- Serve(sctx, l, h) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return gpuEnv{sock: sock, drv: drv, pols: pols, alog: alog, tokens: tokens}
}

// allowGPUs applies the default policy again with settings.gpu set.
func allowGPUs(t *testing.T, pols *policystore.Store, gpuSettings string) {
	t.Helper()
	def, err := policy.Builtin(policy.DefaultName)
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]map[string]json.RawMessage
	if err := json.Unmarshal(def.Files[policy.DataFile], &doc); err != nil {
		t.Fatal(err)
	}
	doc["settings"]["gpu"] = json.RawMessage(gpuSettings)
	data, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	b, err := policy.FromFiles(map[string][]byte{policy.DataFile: data, "gpu_test.rego": []byte("package gpu_test\n\ntest_settings if {\n\tdata.settings.gpu\n}\n")})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := pols.Apply(context.Background(), policy.DefaultName, b); err != nil {
		t.Fatal(err)
	}
}

func createWithGPUs(c *client.Client, name string, gpus ...string) (*connect.Response[apiv1.CreateVMResponse], error) {
	return c.VMs.CreateVM(context.Background(), connect.NewRequest(&apiv1.CreateVMRequest{Name: name, Image: "dev", Gpus: gpus}))
}

func wantCode(t *testing.T, what string, err error, code connect.Code, says ...string) {
	t.Helper()
	if connect.CodeOf(err) != code {
		t.Errorf("%s: %v; want %s", what, err, code)
		return
	}
	for _, s := range says {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("%s: %q does not say %q", what, err, s)
		}
	}
}

func TestGPUPassthroughAPI(t *testing.T) {
	env := gpuAPI(t)
	ctx := context.Background()
	c := client.New(env.sock)

	ls, err := c.GPUs.ListGPUs(ctx, connect.NewRequest(&apiv1.ListGPUsRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if !ls.Msg.Iommu || len(ls.Msg.Gpus) != 3 {
		t.Fatalf("ListGPUs: %v", ls.Msg)
	}
	byAddr := map[string]*apiv1.GPU{}
	for _, g := range ls.Msg.Gpus {
		byAddr[g.Address] = g
	}
	nv := byAddr[gputest.NVIDIAGPU]
	if nv == nil || !nv.Assignable || nv.Ids != "10de:2204" || nv.Driver != "nvidia" || nv.IommuGroup != 1 || nv.Class != "0x030000" || nv.Vm != "" || len(nv.Group) != 2 {
		t.Errorf("nvidia: %v", nv)
	}
	if amd := byAddr[gputest.AMDGPU]; amd == nil || amd.Assignable || !strings.Contains(amd.Reason, "0000:04:00.0") {
		t.Errorf("amd: %v", amd)
	}

	// The default policy gives no VM a GPU.
	_, err = createWithGPUs(c, "train", gputest.NVIDIAGPU)
	wantDenied(t, "create with a GPU under the default policy", err, "carrel.api.gpu_vm")

	allowGPUs(t, env.pols, `{"allowed_vms": ["train", "other"], "devices": ["*"]}`)
	// The policy sees the address in the kernel's spelling.
	resp, err := createWithGPUs(c, "train", strings.ToUpper(gputest.NVIDIAGPU))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(resp.Msg.Vm.Gpus, []string{gputest.NVIDIAGPU}) {
		t.Errorf("vm gpus %v", resp.Msg.Vm.Gpus)
	}
	if got := env.drv.VM(1001).Spec.GPUs; !reflect.DeepEqual(got, []string{gputest.NVIDIAGPU}) {
		t.Errorf("driver spec gpus %v", got)
	}
	ls, err = c.GPUs.ListGPUs(ctx, connect.NewRequest(&apiv1.ListGPUsRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range ls.Msg.Gpus {
		if want := map[bool]string{true: "train", false: ""}[g.Address == gputest.NVIDIAGPU]; g.Vm != want {
			t.Errorf("%s held by %q, want %q", g.Address, g.Vm, want)
		}
	}

	// Refusals, each with its reason; none leaves a VM behind.
	_, err = createWithGPUs(c, "other", gputest.NVIDIAGPU)
	wantCode(t, "a GPU another VM holds", err, connect.CodeFailedPrecondition, `GPU 0000:01:00.0 is already assigned to VM "train"`)
	_, err = createWithGPUs(c, "other", gputest.AMDGPU)
	wantCode(t, "a GPU sharing its group with a NIC", err, connect.CodeFailedPrecondition, "IOMMU group 8 also holds 0000:04:00.0", "would stay behind")
	_, err = createWithGPUs(c, "other", gputest.SharedNIC)
	wantCode(t, "a NIC", err, connect.CodeInvalidArgument, "not a display controller")
	_, err = createWithGPUs(c, "other", "0000:99:00.0")
	wantCode(t, "no such device", err, connect.CodeInvalidArgument, "no PCI device 0000:99:00.0")
	_, err = createWithGPUs(c, "other", "41:00.0")
	wantCode(t, "a malformed address", err, connect.CodeInvalidArgument, "GPU address")
	_, err = createWithGPUs(c, "other", gputest.IntelGPU, gputest.IntelGPU)
	wantCode(t, "a repeated address", err, connect.CodeInvalidArgument, "twice")
	_, err = createWithGPUs(c, "third", gputest.IntelGPU)
	wantDenied(t, "a VM the policy does not name", err, "carrel.api.gpu_vm")
	if _, err := c.VMs.GetVM(ctx, connect.NewRequest(&apiv1.GetVMRequest{Name: "other"})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("a refused create left a VM: %v", err)
	}

	if _, err := c.VMs.StopVM(ctx, connect.NewRequest(&apiv1.StopVMRequest{Name: "train"})); err != nil {
		t.Fatal(err)
	}
	// A policy that no longer allows the VM its GPU stops it getting it
	// again; a stopped VM still holds its GPU.
	allowGPUs(t, env.pols, `{"allowed_vms": ["other"], "devices": ["*"]}`)
	_, err = c.VMs.StartVM(ctx, connect.NewRequest(&apiv1.StartVMRequest{Name: "train"}))
	wantDenied(t, "start after the policy changed", err, "carrel.api.gpu_vm")
	_, err = createWithGPUs(c, "other", gputest.NVIDIAGPU)
	wantCode(t, "the GPU of a stopped VM", err, connect.CodeFailedPrecondition, `assigned to VM "train"`)
	if _, err := c.VMs.DeleteVM(ctx, connect.NewRequest(&apiv1.DeleteVMRequest{Name: "train"})); err != nil {
		t.Fatal(err)
	}
	if _, err := createWithGPUs(c, "other", gputest.NVIDIAGPU); err != nil {
		t.Errorf("the GPU of a deleted VM: %v", err)
	}

	// The audit log has the attach and the detach of train's run, and its
	// lifecycle records name the GPU.
	dir := env.alog.Dir()
	env.alog.Close()
	var steps []string
	if err := audit.Scan(dir, func(_ uint64, _ int64, payload []byte) error {
		r, err := audit.Decode(payload)
		if err != nil || r.VM != "train" {
			return err
		}
		switch r.Kind {
		case audit.KindGPUAttach, audit.KindGPUDetach:
			var d struct {
				GPUs   []string `json:"gpus"`
				Reason string   `json:"reason"`
			}
			if err := json.Unmarshal(r.Data, &d); err != nil {
				return err
			}
			steps = append(steps, r.Kind+" "+strings.Join(d.GPUs, ",")+" "+d.Reason)
		case audit.KindVMLifecycle:
			var d struct {
				Event string   `json:"event"`
				GPUs  []string `json:"gpus"`
			}
			if err := json.Unmarshal(r.Data, &d); err != nil {
				return err
			}
			steps = append(steps, d.Event+" "+strings.Join(d.GPUs, ","))
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	want := []string{
		"created 0000:01:00.0", "starting 0000:01:00.0", "gpu.attach 0000:01:00.0 ", "started 0000:01:00.0",
		"stopping 0000:01:00.0", "gpu.detach 0000:01:00.0 stopped", "stopped 0000:01:00.0", "removed 0000:01:00.0",
	}
	if !reflect.DeepEqual(steps, want) {
		t.Errorf("train's records:\n%s\nwant:\n%s", strings.Join(steps, "\n"), strings.Join(want, "\n"))
	}
}

// A call that names its VM in the request is decided for that VM: a
// Carrel-Vm header naming another cannot borrow that VM's permissions (a
// token scoped to a running a command in b).
func TestHeaderCannotNameAnotherVM(t *testing.T) {
	env := gpuAPI(t)
	ctx := context.Background()
	op := client.New(env.sock)
	for _, n := range []string{"a", "b"} {
		if _, err := op.VMs.CreateVM(ctx, connect.NewRequest(&apiv1.CreateVMRequest{Name: n, Image: "dev"})); err != nil {
			t.Fatal(err)
		}
	}
	_, secret, err := env.tokens.Create("a", 0)
	if err != nil {
		t.Fatal(err)
	}
	tok := client.New(env.sock, client.WithToken(secret))
	req := connect.NewRequest(&apiv1.ExecRequest{Vm: "b", Argv: []string{"echo", "hi"}})
	req.Header().Set(protocol.VMHeader, "a")
	s, err := tok.VMs.Exec(ctx, req)
	if err == nil {
		for s.Receive() {
			t.Errorf("exec in b with a's token relayed: %v", s.Msg())
		}
		err = s.Err()
	}
	wantCode(t, "exec in b naming a in the header", err, connect.CodeInvalidArgument, `header names VM "a", the request VM "b"`)
	// Without the header the token is refused for b, and allowed for a.
	s, err = tok.VMs.Exec(ctx, connect.NewRequest(&apiv1.ExecRequest{Vm: "b", Argv: []string{"echo", "hi"}}))
	if err == nil {
		for s.Receive() {
		}
		err = s.Err()
	}
	wantDenied(t, "exec in b with a's token", err, "carrel.api.token_vm")
	req = connect.NewRequest(&apiv1.ExecRequest{Vm: "a", Argv: []string{"echo", "hi"}})
	req.Header().Set(protocol.VMHeader, "a")
	s, err = tok.VMs.Exec(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	for s.Receive() {
	}
	if err := s.Err(); err != nil {
		t.Errorf("exec in a with a's token, header agreeing: %v", err)
	}
}
