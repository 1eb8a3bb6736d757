package libvirt

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	lv "github.com/digitalocean/go-libvirt"
	"libvirt.org/go/libvirtxml"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/accel"
	"github.com/carrel-os/carrel/supervisor/driver"
	"github.com/carrel-os/carrel/supervisor/driver/libvirt/libvirttest"
)

// These tests run the driver against the real libvirtd, with a few-byte
// multiboot "kernel" instead of an image, so that they need neither an
// image build nor a guest boot: QEMU loads it, and once resumed it halts
// forever (haltKernel) or triple-faults, which ends the domain as a guest
// reboot does (faultKernel). The end-to-end test in tests/ boots the real
// image through the libvirt driver.

// multiboot returns a multiboot image loaded at 1 MiB that runs code.
func multiboot(code []byte) []byte {
	const magic, flags, base uint32 = 0x1BADB002, 0x00010000, 0x100000
	sum := magic + flags
	img := make([]byte, 64)
	for i, v := range []uint32{magic, flags, -sum, base, base, 0, 0, base + 32} {
		binary.LittleEndian.PutUint32(img[4*i:], v)
	}
	copy(img[32:], code)
	return img // bytes 48-53 stay zero: an empty IDT descriptor
}

var (
	// hlt; jmp back to hlt.
	haltKernel = multiboot([]byte{0xF4, 0xEB, 0xFD})
	// lidt [base+48] (an IDT of limit 0); int3: no handler, no double
	// fault handler, so the CPU resets, and -no-reboot ends QEMU.
	faultKernel = multiboot([]byte{0x0F, 0x01, 0x1D, 0x30, 0x00, 0x10, 0x00, 0xCC, 0xF4, 0xEB, 0xFD})
)

type env struct {
	t   *testing.T
	d   *Driver
	dir string // a 0700 tree, as carreld's state dir is
}

func newEnv(t *testing.T) *env {
	t.Helper()
	if err := libvirttest.Ensure(); errors.Is(err, libvirttest.ErrUnavailable) {
		t.Skip("needs a real libvirtd: ", err)
	} else if err != nil {
		t.Fatal(err)
	}
	d, err := New(Config{Accelerator: accel.TCG, Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	// Short: the sockets must fit in sun_path.
	dir, err := os.MkdirTemp("/tmp", "clv-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return &env{t: t, d: d, dir: dir}
}

// spec writes kernel and an initrd into a fresh VM directory.
func (e *env) spec(kernel []byte) driver.Spec {
	e.t.Helper()
	var b [4]byte
	rand.Read(b[:])
	name := "t" + hex.EncodeToString(b[:])
	vmDir := filepath.Join(e.dir, "vms", name)
	img := filepath.Join(e.dir, "images")
	for _, p := range []string{vmDir, img} {
		if err := os.MkdirAll(p, 0o700); err != nil {
			e.t.Fatal(err)
		}
	}
	k, i := filepath.Join(img, name+"-kernel"), filepath.Join(img, name+"-initrd")
	if err := os.WriteFile(k, kernel, 0o400); err != nil {
		e.t.Fatal(err)
	}
	if err := os.WriteFile(i, []byte("initrd"), 0o400); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { e.destroyByName(DomainName(name)) })
	return driver.Spec{Name: name, Kernel: k, Initrd: i, Cmdline: "console=ttyS0", MemoryBytes: 64 << 20, CPUs: 1, Dir: vmDir}
}

// destroyByName ends a domain whatever its metadata says, so a failed test
// leaves nothing behind.
func (e *env) destroyByName(name string) {
	_ = e.d.do(context.Background(), "clean up", func(c *lv.Libvirt) error {
		dom, err := c.DomainLookupByName(name)
		if err != nil {
			return err
		}
		c.DomainDestroy(dom)
		c.DomainUndefine(dom)
		return nil
	})
}

// state is the domain's state, or -1 when libvirt has no such domain.
func (e *env) state(name string) lv.DomainState {
	e.t.Helper()
	var st int32
	err := e.d.do(context.Background(), "state", func(c *lv.Libvirt) error {
		dom, err := c.DomainLookupByName(name)
		if err != nil {
			return err
		}
		st, _, err = c.DomainGetState(dom, 0)
		return err
	})
	if lv.IsNotFound(err) {
		return -1
	}
	if err != nil {
		e.t.Fatal(err)
	}
	return lv.DomainState(st)
}

func waitErr(ctx context.Context, d *Driver, inst driver.Instance) <-chan error {
	ch := make(chan error, 1)
	go func() { ch <- d.Wait(ctx, inst) }()
	return ch
}

// awaitWaiting returns once the driver's waiting hook, which sends each
// waiting domain's name on waiting, has reported a Wait on each of domains.
func awaitWaiting(t *testing.T, waiting <-chan string, domains ...string) {
	t.Helper()
	want := map[string]int{}
	for _, d := range domains {
		want[d]++
	}
	timeout := time.After(30 * time.Second)
	for range domains {
		select {
		case d := <-waiting:
			if want[d] == 0 {
				t.Fatalf("a wait on %s is in place, not one of %v", d, domains)
			}
			want[d]--
		case <-timeout:
			t.Fatalf("waits not in place after 30s: %v", want)
		}
	}
}

func TestLifecycleOnLibvirtd(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	spec := e.spec(haltKernel)
	inst, err := e.d.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if inst.Driver != Name || inst.Domain != "carrel-"+spec.Name || inst.DomainUUID == "" || inst.PID == 0 || inst.CID != 0 {
		t.Errorf("instance: %+v", inst)
	}
	if st := e.state(inst.Domain); st != lv.DomainPaused {
		t.Errorf("after start: state %d, want paused", st)
	}
	if inst.DataSocket != filepath.Join(spec.Dir, dataSocketName) {
		t.Errorf("data socket %q", inst.DataSocket)
	}
	for _, p := range []string{inst.AgentSocket, inst.DataSocket, inst.ConsoleSocket} {
		if fi, err := os.Stat(p); err != nil || fi.Mode()&os.ModeSocket == 0 {
			t.Errorf("socket %s: %v", p, err)
		}
	}
	// libvirt puts both ports on the one virtio-serial controller, the
	// agent's first, as QEMU numbers the qemu driver's.
	dom, err := e.d.instDomain(ctx, inst)
	if err != nil {
		t.Fatal(err)
	}
	live, err := e.d.liveDomain(ctx, dom)
	if err != nil {
		t.Fatal(err)
	}
	var ports []string
	for _, ch := range live.Devices.Channels {
		if ch.Target != nil && ch.Target.VirtIO != nil && ch.Address != nil && ch.Address.VirtioSerial != nil {
			a := ch.Address.VirtioSerial
			ports = append(ports, fmt.Sprintf("%s %d:%d:%d", ch.Target.VirtIO.Name, *a.Controller, *a.Bus, *a.Port))
		}
	}
	if want := []string{protocol.SerialPortName + " 0:0:1", protocol.DataPortName + " 0:0:2"}; !slices.Equal(ports, want) {
		t.Errorf("virtio-serial ports %v, want %v", ports, want)
	}
	// The console, the agent port and the data port are there to connect
	// to, before the guest runs.
	for _, dial := range []driver.Dialer{e.d.ConsoleDialer(inst), func() driver.Dialer { d, _ := e.d.AgentDialer(inst); return d }(), driver.DataDialer(inst)} {
		c, err := dial(ctx)
		if err != nil {
			t.Errorf("dial: %v", err)
			continue
		}
		c.Close()
	}
	// QEMU runs as libvirt's user, under seccomp, and libvirt chowned
	// nothing of carreld's.
	status, _ := os.ReadFile("/proc/" + strconv.Itoa(inst.PID) + "/status")
	if !strings.Contains(string(status), "Seccomp:\t2") || strings.Contains(string(status), "Uid:\t0\t") {
		t.Errorf("qemu %d status:\n%s", inst.PID, status)
	}
	if fi, _ := os.Stat(spec.Kernel); fi.Sys().(*syscall.Stat_t).Uid != 0 {
		t.Error("libvirt chowned the kernel")
	}
	// The host limits are on the domain's cgroup before the guest runs:
	// 64 MiB and TCG's 1.5 GiB, one vCPU and one CPU more; and QEMU's
	// locked-memory limit was left alone.
	l, err := libvirttest.ReadLimits(inst.PID)
	if err != nil {
		t.Fatal(err)
	}
	if l.MemoryBytes != (64<<20)+(1536<<20) || l.CPUQuota != 200000 || l.CPUPeriod != 100000 {
		t.Errorf("domain cgroup limits: %+v", l)
	}
	if limits, _ := os.ReadFile("/proc/" + strconv.Itoa(inst.PID) + "/limits"); strings.Contains(string(limits), "1677721600") {
		t.Errorf("qemu's limits mention the memory limit:\n%s", limits)
	}

	if err := e.d.Resume(ctx, inst); err != nil {
		t.Fatal(err)
	}
	if st := e.state(inst.Domain); st != lv.DomainRunning {
		t.Errorf("after resume: state %d", st)
	}
	if err := e.d.Pause(ctx, inst); err != nil {
		t.Fatal(err)
	}
	if st := e.state(inst.Domain); st != lv.DomainPaused {
		t.Errorf("after pause: state %d", st)
	}
	if err := e.d.Resume(ctx, inst); err != nil {
		t.Fatal(err)
	}
	// A new connection, as after a carreld restart, adopts it.
	d2, err := New(Config{Accelerator: accel.TCG})
	if err != nil {
		t.Fatal(err)
	}
	defer d2.Close()
	if _, err := d2.Adopt(ctx, inst); err != nil {
		t.Fatalf("adopt: %v", err)
	}

	// Waits share one event subscription (libvirtd allows one per
	// connection): two on this domain, as carreld's exit watcher and a
	// stop do, and one on another domain. The other domain's end is seen
	// at once, and does not end the waits on this one.
	other, err := d2.Start(ctx, e.spec(haltKernel))
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	waiting := make(chan string, 16)
	d2.waiting = func(i driver.Instance) {
		select {
		case waiting <- i.Domain:
		default: // a wait retried past the buffer: the test fails anyway
		}
	}
	waited, waited2 := waitErr(wctx, d2, inst), waitErr(wctx, d2, inst)
	awaitWaiting(t, waiting, inst.Domain, inst.Domain) // these watch first
	otherWaited := waitErr(wctx, d2, other)
	awaitWaiting(t, waiting, other.Domain) // so its end comes as an event
	if err := d2.Kill(ctx, other); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-otherWaited:
		if err != nil {
			t.Errorf("wait on the other domain: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the other domain's end went unnoticed")
	}
	select {
	case err := <-waited:
		t.Fatalf("wait returned while the vm runs: %v", err)
	case err := <-waited2:
		t.Fatalf("wait returned while the vm runs: %v", err)
	case <-time.After(500 * time.Millisecond):
	}
	if err := e.d.Kill(ctx, inst); err != nil {
		t.Fatal(err)
	}
	for _, w := range []<-chan error{waited, waited2} {
		if err := <-w; err != nil {
			t.Errorf("wait after kill: %v", err)
		}
	}
	if st := e.state(inst.Domain); st != -1 {
		t.Errorf("after kill: domain still there, state %d", st)
	}
	if err := e.d.Kill(ctx, inst); err != nil {
		t.Errorf("second kill: %v", err)
	}
	if _, err := e.d.Adopt(ctx, inst); !errors.Is(err, driver.ErrNotRunning) {
		t.Errorf("adopt after kill: %v", err)
	}
	if err := e.d.Wait(ctx, inst); err != nil {
		t.Errorf("wait on a gone domain: %v", err)
	}
}

func TestGuestExitEndsWait(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	inst, err := e.d.Start(ctx, e.spec(faultKernel))
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	waited := waitErr(wctx, e.d, inst)
	if err := e.d.Resume(ctx, inst); err != nil {
		t.Fatal(err)
	}
	if err := <-waited; err != nil {
		t.Fatalf("wait: %v", err)
	}
	if _, err := e.d.Adopt(ctx, inst); !errors.Is(err, driver.ErrNotRunning) {
		t.Errorf("adopt after the guest ended: %v", err)
	}
}

func TestStartFailureLeavesNothing(t *testing.T) {
	e := newEnv(t)
	spec := e.spec([]byte("not a kernel"))
	_, err := e.d.Start(context.Background(), spec)
	if err == nil || !strings.Contains(err.Error(), "create domain") {
		t.Fatalf("start with a bad kernel: %v", err)
	}
	if st := e.state(DomainName(spec.Name)); st != -1 {
		t.Errorf("domain left in state %d", st)
	}
	if err := e.d.Sweep(context.Background(), spec.Dir); err != nil {
		t.Errorf("sweep: %v", err)
	}
}

// TestSweepEndsOnlyItsOwnLeftover: a Start whose Instance was lost (carreld
// died) is found from the marker; domains that are not carrel's, or are
// for another directory, are left alone even when the marker names them.
func TestSweepEndsOnlyItsOwnLeftover(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	spec := e.spec(haltKernel)
	if _, err := e.d.Start(ctx, spec); err != nil {
		t.Fatal(err)
	}
	other := e.spec(haltKernel)
	if err := e.d.Sweep(ctx, other.Dir); err != nil {
		t.Errorf("sweep of an empty dir: %v", err)
	}
	if st := e.state(DomainName(spec.Name)); st != lv.DomainPaused {
		t.Fatalf("sweep of another dir touched the domain: state %d", st)
	}
	if err := e.d.Sweep(ctx, spec.Dir); err != nil {
		t.Fatal(err)
	}
	if st := e.state(DomainName(spec.Name)); st != -1 {
		t.Errorf("after sweep: state %d", st)
	}

	// A persistent, inactive domain that is not carrel's, though its name
	// starts like ours; and a marker that points at it.
	foreign := defineForeign(t, e)
	if err := writeMarker(filepath.Join(other.Dir, markerName), marker{Domain: foreign.name, UUID: foreign.uuid}); err != nil {
		t.Fatal(err)
	}
	inst := driver.Instance{Driver: Name, Domain: foreign.name, DomainUUID: foreign.uuid, AgentSocket: filepath.Join(other.Dir, agentSocketName)}
	if err := e.d.Sweep(ctx, other.Dir); err != nil {
		t.Errorf("sweep: %v", err)
	}
	if err := e.d.Kill(ctx, inst); err != nil {
		t.Errorf("kill: %v", err)
	}
	if _, err := e.d.Adopt(ctx, inst); !errors.Is(err, driver.ErrNotRunning) || !strings.Contains(err.Error(), "not carrel's") {
		t.Errorf("adopt of a foreign domain: %v", err)
	}
	if st := e.state(foreign.name); st != lv.DomainShutoff {
		t.Errorf("foreign domain: state %d, want still defined and shut off", st)
	}
}

type foreignDomain struct{ name, uuid string }

// defineForeign defines a domain the way another tool would: no carrel
// metadata.
func defineForeign(t *testing.T, e *env) foreignDomain {
	t.Helper()
	uuid, err := newUUID()
	if err != nil {
		t.Fatal(err)
	}
	name := "carrel-foreign-" + uuid[:8]
	dom := libvirtxml.Domain{
		Type: "qemu", Name: name, UUID: uuid,
		Memory: &libvirtxml.DomainMemory{Value: 64, Unit: "MiB"},
		OS:     &libvirtxml.DomainOS{Type: &libvirtxml.DomainOSType{Arch: "x86_64", Type: "hvm"}},
	}
	x, err := dom.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	err = e.d.do(context.Background(), "define", func(c *lv.Libvirt) error {
		_, err := c.DomainDefineXML(x)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.destroyByName(name) })
	return foreignDomain{name, uuid}
}
