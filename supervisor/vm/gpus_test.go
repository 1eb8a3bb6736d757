package vm

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/carrel-os/carrel/supervisor/driver"
	"github.com/carrel-os/carrel/supervisor/driver/drivertest"
	"github.com/carrel-os/carrel/supervisor/registry"
)

var errHeld = errors.New("held")

// gpuChecker stands in for supervisor/gpu.Host.Check: it refuses a GPU
// another VM holds, and remembers what it was shown.
type gpuChecker struct {
	mu    sync.Mutex
	calls []map[string][]string
}

func (c *gpuChecker) check(want []string, held map[string][]string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls = append(c.calls, held)
	for vm, gpus := range held {
		for _, g := range want {
			if slices.Contains(gpus, g) {
				return fmt.Errorf("%w: %s by %s", errHeld, g, vm)
			}
		}
	}
	return nil
}

func (e *env) withGPUs(l *eventLog, c *gpuChecker, drv driver.Driver) {
	e.m.Close()
	e.m = New(Config{Registry: e.reg, Images: e.img, Driver: drv, BootTimeout: 2 * time.Second, StopTimeout: time.Second,
		OnEvent: l.on, CheckGPUs: c.check})
}

const testGPU = "0000:01:00.0"

func TestGPULifecycle(t *testing.T) {
	e := newEnv(t)
	l, c := &eventLog{}, &gpuChecker{}
	e.withGPUs(l, c, e.drv)
	ctx := context.Background()
	// Spelled in upper case: recorded in the kernel's spelling.
	rec, err := e.m.Create(ctx, CreateParams{Name: "a", Image: "dev", GPUs: []string{strings.ToUpper(testGPU)}})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(rec.GPUs, []string{testGPU}) || !reflect.DeepEqual(e.drv.VM(rec.Instance.PID).Spec.GPUs, []string{testGPU}) {
		t.Errorf("record gpus %v, driver spec gpus %v", rec.GPUs, e.drv.VM(rec.Instance.PID).Spec.GPUs)
	}
	if onDisk, _ := e.reg.Get("a"); !reflect.DeepEqual(onDisk.GPUs, []string{testGPU}) {
		t.Errorf("persisted gpus %v", onDisk.GPUs)
	}
	// Another VM may not have it, running or stopped; the checker is
	// shown who holds what.
	if _, err := e.m.Create(ctx, CreateParams{Name: "b", Image: "dev", GPUs: []string{testGPU}}); !errors.Is(err, errHeld) {
		t.Errorf("second create of the GPU: %v", err)
	}
	if _, err := e.m.Get("b"); !errors.Is(err, ErrNotFound) {
		t.Errorf("refused create left b: %v", err)
	}
	if got := c.calls[len(c.calls)-1]; !reflect.DeepEqual(got, map[string][]string{"a": {testGPU}}) {
		t.Errorf("held %v", got)
	}
	if _, err := e.m.Stop(ctx, "a", false); err != nil {
		t.Fatal(err)
	}
	if _, err := e.m.Create(ctx, CreateParams{Name: "b", Image: "dev", GPUs: []string{testGPU}}); !errors.Is(err, errHeld) {
		t.Errorf("create of a stopped VM's GPU: %v", err)
	}
	// A VM without GPUs is not shown to the checker, nor are its events
	// about GPUs.
	e.create(t, "plain")
	if _, err := e.m.Start(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if err := e.m.Delete(ctx, "a", true); err != nil {
		t.Fatal(err)
	}
	var aKinds []string
	for _, ev := range l.evs {
		if ev.Record.Name == "a" {
			aKinds = append(aKinds, string(ev.Kind))
		} else if strings.HasPrefix(string(ev.Kind), "gpu") {
			t.Errorf("%s of %s", ev.Kind, ev.Record.Name)
		}
	}
	want := "created,starting,gpu-attach,started,stopping,gpu-detach,stopped,starting,gpu-attach,started,stopping,gpu-detach,stopped,removed"
	if got := strings.Join(aKinds, ","); got != want {
		t.Errorf("events of a:\n%s\nwant\n%s", got, want)
	}
	// Deleted, a's GPU is free.
	if _, err := e.m.Create(ctx, CreateParams{Name: "b", Image: "dev", GPUs: []string{testGPU}}); err != nil {
		t.Errorf("create of a deleted VM's GPU: %v", err)
	}
}

func TestCreateGPUsRefused(t *testing.T) {
	e := newEnv(t) // no CheckGPUs
	ctx := context.Background()
	for _, gpus := range [][]string{{testGPU}, {"01:00.0"}, {testGPU, testGPU}} {
		if _, err := e.m.Create(ctx, CreateParams{Name: "a", Image: "dev", GPUs: gpus}); !errors.Is(err, ErrInvalid) {
			t.Errorf("create with gpus %v: %v, want ErrInvalid", gpus, err)
		}
	}
	if n := e.drv.Running(); n != 0 {
		t.Errorf("%d VMs started", n)
	}
}

// An attach that cannot be recorded stops the boot before QEMU starts;
// a boot that fails after the attach records the detach.
func TestGPUAttachRecordedFirst(t *testing.T) {
	e := newEnv(t)
	l := &eventLog{fail: map[EventKind]error{EventGPUAttach: errors.New("disk full")}}
	e.withGPUs(l, &gpuChecker{}, e.drv)
	ctx := context.Background()
	if _, err := e.m.Create(ctx, CreateParams{Name: "a", Image: "dev", GPUs: []string{testGPU}}); err == nil || !strings.Contains(err.Error(), "disk full") {
		t.Fatalf("create: %v", err)
	}
	if n := e.drv.Running(); n != 0 {
		t.Errorf("%d VMs started", n)
	}
	if got := l.kinds(); got != "created,starting,gpu-attach,failed" {
		t.Errorf("events %s", got)
	}

	l2 := &eventLog{}
	e.withGPUs(l2, &gpuChecker{}, e.drv)
	e.drv.SetNext(drivertest.Behavior{StartErr: errors.New("vfio: group not viable")})
	if _, err := e.m.Create(ctx, CreateParams{Name: "a", Image: "dev", GPUs: []string{testGPU}}); err == nil {
		t.Fatal("create succeeded")
	}
	if got := l2.kinds(); got != "created,starting,gpu-attach,gpu-detach,failed" {
		t.Errorf("events %s", got)
	}
}

// killSpy records Kill calls.
type killSpy struct {
	driver.Driver
	mu     sync.Mutex
	killed []int
	swept  []string
}

func (k *killSpy) Sweep(ctx context.Context, dir string) error {
	k.mu.Lock()
	k.swept = append(k.swept, dir)
	k.mu.Unlock()
	return k.Driver.Sweep(ctx, dir)
}

func (k *killSpy) Kill(ctx context.Context, inst driver.Instance) error {
	k.mu.Lock()
	k.killed = append(k.killed, inst.PID)
	k.mu.Unlock()
	return k.Driver.Kill(ctx, inst)
}

// A VM with GPUs that died while carreld was down: reconcile has the
// driver let go of what it held, and records the detach.
func TestReconcileReleasesDeadVMsGPUs(t *testing.T) {
	e := newEnv(t)
	e.withGPUs(&eventLog{}, &gpuChecker{}, e.drv)
	rec, err := e.m.Create(context.Background(), CreateParams{Name: "g", Image: "dev", GPUs: []string{testGPU}})
	if err != nil {
		t.Fatal(err)
	}
	e.m.Close()
	e.drv.VM(rec.Instance.PID).Exit()

	l, spy := &eventLog{}, &killSpy{Driver: e.drv}
	e.withGPUs(l, &gpuChecker{}, spy)
	if err := e.m.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(spy.killed, rec.Instance.PID) {
		t.Errorf("kills %v: the dead VM's instance was not released", spy.killed)
	}
	if got := l.kinds(); got != "gpu-detach,stopped" {
		t.Errorf("events %s", got)
	}
	if st, _ := e.m.Get("g"); st.State != registry.StateStopped || !reflect.DeepEqual(st.GPUs, []string{testGPU}) {
		t.Errorf("after reconcile: %+v", st)
	}
}

// TestReconcileInterruptedCreateWithGPUs: a create with GPUs that a
// carreld death cut short is removed at the next start, after its
// leftovers are swept (the driver gives back what it bound), with its
// gpu.detach record.
func TestReconcileInterruptedCreateWithGPUs(t *testing.T) {
	e := newEnv(t)
	e.reg.Put(&registry.Record{Name: "g", State: registry.StateCreating, GPUs: []string{testGPU}, CreatedAt: time.Now()})
	l, spy := &eventLog{}, &killSpy{Driver: e.drv}
	e.withGPUs(l, &gpuChecker{}, spy)
	if err := e.m.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(spy.swept, e.reg.Dir("g")) {
		t.Errorf("sweeps %v: the interrupted create's directory was not swept", spy.swept)
	}
	if got := l.kinds(); got != "gpu-detach" {
		t.Errorf("events %s, want gpu-detach", got)
	}
	ev, _ := l.find(EventGPUDetach)
	if ev.Record.Name != "g" || !strings.Contains(ev.Reason, "create interrupted") {
		t.Errorf("gpu-detach %+v", ev)
	}
	if _, err := e.reg.Get("g"); !errors.Is(err, registry.ErrNotFound) {
		t.Errorf("the record is still there: %v", err)
	}
}
