package qemu

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/digitalocean/go-qemu/qmp"
	"github.com/digitalocean/go-qemu/qmp/qmptest"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/driver"
)

func testSpec(dir string) driver.Spec {
	return driver.Spec{Name: "demo", Kernel: "/k", Initrd: "/i", Cmdline: "console=ttyS0", MemoryBytes: 512 << 20, CPUs: 2, Dir: dir}
}

func argValue(a []string, flag string) []string {
	var v []string
	for i := 0; i+1 < len(a); i++ {
		if a[i] == flag {
			v = append(v, a[i+1])
		}
	}
	return v
}

func TestArgs(t *testing.T) {
	l, err := newLayout("/run/x")
	if err != nil {
		t.Fatal(err)
	}
	spec := testSpec("/run/x")
	a := args(spec, MachineMicroVM, "tcg", l)
	if got := argValue(a, "-machine"); len(got) != 1 || got[0] != "microvm,accel=tcg" {
		t.Errorf("machine = %v", got)
	}
	if got := argValue(a, "-append"); got[0] != "console=ttyS0 reboot=t tsc=reliable" {
		t.Errorf("microvm cmdline = %v", got)
	}
	if got := argValue(a, "-m"); got[0] != "512M" {
		t.Errorf("-m = %v", got)
	}
	if got := argValue(a, "-smp"); got[0] != "2" {
		t.Errorf("-smp = %v", got)
	}
	for _, want := range []string{"-S", "-nodefaults", "-no-reboot"} {
		if !slices.Contains(a, want) {
			t.Errorf("missing %s", want)
		}
	}
	devs := strings.Join(argValue(a, "-device"), " ")
	if !strings.Contains(devs, "virtio-serial-device") || strings.Contains(devs, "vsock") {
		t.Errorf("devices = %s", devs)
	}
	if strings.Contains(strings.Join(a, " "), "netdev") {
		t.Errorf("a VM must have no NIC: %v", a)
	}
	if got := argValue(a, "-incoming"); got != nil {
		t.Errorf("a boot with -incoming %v", got)
	}

	spec.CID = 7
	a = args(spec, MachineQ35, "kvm", l)
	devs = strings.Join(argValue(a, "-device"), " ")
	if !strings.Contains(devs, "virtio-serial-pci") || !strings.Contains(devs, "vhost-vsock-pci,guest-cid=7") {
		t.Errorf("q35 devices = %s", devs)
	}
	if got := argValue(a, "-append"); got[0] != "console=ttyS0" {
		t.Errorf("q35 cmdline under KVM = %v", got)
	}
	spec.Cmdline = "console=ttyS0 tsc=nowatchdog"
	if got := argValue(args(spec, MachineQ35, "tcg", l), "-append"); got[0] != "console=ttyS0 tsc=nowatchdog" {
		t.Errorf("an image's own tsc= must win: %v", got)
	}
	if got := argValue(a, "-cpu"); got[0] != "host" {
		t.Errorf("kvm cpu = %v", got)
	}
	if got := argValue(args(spec, MachineQ35, "tcg", l), "-cpu"); got[0] != "max,erms=off" {
		t.Errorf("tcg cpu = %v", got)
	}
}

// TestArgsPorts: the agent and data ports share the virtio-serial device,
// each on the listening socket passed at its descriptor; a VM without a
// data port has neither its socket nor its port, and the saved state it
// starts from takes the descriptor after the sockets'.
func TestArgsPorts(t *testing.T) {
	l, err := newLayout("/run/x")
	if err != nil {
		t.Fatal(err)
	}
	spec := testSpec("/run/x")
	spec.Incoming = os.Stdin
	a := args(spec, MachineQ35, "tcg", l)
	chardevs, devs := argValue(a, "-chardev"), argValue(a, "-device")
	for _, want := range []string{"socket,id=agent,fd=4,server=on,wait=off", "socket,id=data,fd=6,server=on,wait=off"} {
		if !slices.Contains(chardevs, want) {
			t.Errorf("no chardev %s: %v", want, chardevs)
		}
	}
	for _, want := range []string{
		"virtserialport,bus=vser0.0,chardev=agent,name=" + protocol.SerialPortName,
		"virtserialport,bus=vser0.0,chardev=data,name=" + protocol.DataPortName,
	} {
		if !slices.Contains(devs, want) {
			t.Errorf("no device %s: %v", want, devs)
		}
	}
	if got := argValue(a, "-incoming"); !slices.Equal(got, []string{"fd:7"}) {
		t.Errorf("-incoming %v, want fd:7", got)
	}

	spec.NoDataPort = true
	a = args(spec, MachineQ35, "tcg", l)
	if s := strings.Join(a, " "); strings.Contains(s, "id=data") || strings.Contains(s, protocol.DataPortName) {
		t.Errorf("a vm without a data port has one: %s", s)
	}
	if got := argValue(a, "-incoming"); !slices.Equal(got, []string{"fd:6"}) {
		t.Errorf("-incoming %v without a data port, want fd:6", got)
	}
}

func TestArgsDisks(t *testing.T) {
	l, err := newLayout("/run/x")
	if err != nil {
		t.Fatal(err)
	}
	spec := testSpec("/run/x")
	if a := strings.Join(args(spec, MachineQ35, "tcg", l), " "); strings.Contains(a, "-drive") || strings.Contains(a, "virtio-blk") {
		t.Errorf("a disk without disks: %s", a)
	}
	spec.Disks = []driver.Disk{
		{Path: "/var/lib/carrel/images/blobs/sha256/s", Format: driver.FormatRaw, ReadOnly: true, Serial: "carrel-system"},
		{Path: "/var/lib/carrel/vms/a,b/workspace.qcow2", Format: driver.FormatQCOW2, Backing: "/var/lib/carrel/images/blobs/sha256/t", Serial: "carrel-workspace"},
	}
	for machine, dev := range map[string]string{MachineQ35: "virtio-blk-pci", MachineMicroVM: "virtio-blk-device"} {
		a := args(spec, machine, "tcg", l)
		// A comma in the path is doubled, or QEMU would read an option; a
		// read-only disk is opened read-only, a writable one passes discards.
		want := []string{
			"if=none,id=disk0,format=raw,file=/var/lib/carrel/images/blobs/sha256/s,readonly=on",
			"if=none,id=disk1,format=qcow2,file=/var/lib/carrel/vms/a,,b/workspace.qcow2,discard=unmap",
		}
		if got := argValue(a, "-drive"); !slices.Equal(got, want) {
			t.Errorf("%s: -drive %v", machine, got)
		}
		devs := argValue(a, "-device")
		if !slices.Contains(devs, dev+",drive=disk0,serial=carrel-system") || !slices.Contains(devs, dev+",drive=disk1,serial=carrel-workspace") {
			t.Errorf("%s: devices %v", machine, devs)
		}
	}
}

func TestLayoutRejectsLongPaths(t *testing.T) {
	_, err := newLayout("/" + strings.Repeat("x", 120))
	if err == nil || !strings.Contains(err.Error(), "longer than") {
		t.Fatalf("err = %v", err)
	}
}

func TestResumeAndAdoptUseQMP(t *testing.T) {
	var cmds []string
	d := New(Config{Accelerator: "tcg", NewMonitor: func(string) (qmp.Monitor, error) {
		return qmptest.NewMonitor(func(cmd qmp.Command) (any, error) {
			cmds = append(cmds, cmd.Execute)
			switch cmd.Execute {
			case "query-status":
				return map[string]any{"return": map[string]any{"running": true, "status": "running"}}, nil
			default:
				return map[string]any{"return": map[string]any{}}, nil
			}
		}), nil
	}})
	// Our own process stands in for a running QEMU.
	start, _, err := procStartTime(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	inst := driver.Instance{PID: os.Getpid(), StartTime: start, QMPSocket: "unused"}
	if err := d.Resume(context.Background(), inst); err != nil {
		t.Fatal(err)
	}
	if paused, err := d.Adopt(context.Background(), inst); err != nil || paused {
		t.Fatalf("adopt: paused %v, %v", paused, err)
	}
	if !slices.Equal(cmds, []string{"cont", "query-status"}) {
		t.Errorf("qmp commands = %v", cmds)
	}
	// A reused pid (same pid, different start time) is not ours.
	inst.StartTime++
	if _, err := d.Adopt(context.Background(), inst); !errors.Is(err, driver.ErrNotRunning) {
		t.Errorf("adopt with wrong start time: %v", err)
	}
}

func TestWaitAndKillProcess(t *testing.T) {
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go cmd.Wait() // reap, as init would for an adopted QEMU
	start, _, err := procStartTime(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	inst := driver.Instance{PID: cmd.Process.Pid, StartTime: start, QMPSocket: filepath.Join(t.TempDir(), "none.sock")}
	d := New(Config{})
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := d.Wait(ctx, inst); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("wait on a running process with a short deadline: %v", err)
	}
	// No QMP socket: Kill falls back to SIGKILL.
	if err := d.Kill(context.Background(), inst); err != nil {
		t.Fatal(err)
	}
	if err := d.Wait(context.Background(), inst); err != nil {
		t.Fatal(err)
	}
	if alive(inst.PID, inst.StartTime) {
		t.Fatal("process still alive after Kill")
	}
	if err := d.Kill(context.Background(), inst); err != nil {
		t.Errorf("kill of a dead VM: %v", err)
	}
}

func TestStartFailureReportsQEMUError(t *testing.T) {
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("qemu-system-x86_64 not installed: run `make deps`")
	}
	dir := t.TempDir()
	spec := testSpec(dir)
	spec.Kernel = filepath.Join(dir, "no-such-kernel")
	_, err := New(Config{Accelerator: "tcg"}).Start(context.Background(), spec)
	if err == nil || !strings.Contains(err.Error(), "no-such-kernel") {
		t.Fatalf("err = %v, want qemu's complaint about the kernel", err)
	}
	for _, s := range []string{qmpSocketName, agentSocketName, dataSocketName, consoleSocketName} {
		if _, err := os.Stat(filepath.Join(dir, s)); err == nil {
			t.Errorf("socket %s left behind", s)
		}
	}
}

func TestSweepKillsOnlyOurLeftover(t *testing.T) {
	dir := t.TempDir()
	pidfile := filepath.Join(dir, pidFileName)
	// A process whose command line names this VM's pid file stands in for a
	// QEMU whose Start never returned.
	ours := exec.Command("sh", "-c", "sleep 60; true", pidfile)
	other := exec.Command("sh", "-c", "sleep 60; true", "unrelated")
	for _, c := range []*exec.Cmd{ours, other} {
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		go c.Wait()
	}
	defer other.Process.Kill()
	d := New(Config{})

	// A pid file pointing at someone else's process (a reused pid) is left.
	os.WriteFile(pidfile, []byte(strconv.Itoa(other.Process.Pid)+"\n"), 0o600)
	if err := d.Sweep(context.Background(), dir); err != nil {
		t.Fatal(err)
	}
	if st, _, _ := procStartTime(other.Process.Pid); st == 0 {
		t.Fatal("swept a process that is not ours")
	}

	os.WriteFile(pidfile, []byte(strconv.Itoa(ours.Process.Pid)+"\n"), 0o600)
	start, _, _ := procStartTime(ours.Process.Pid)
	if err := d.Sweep(context.Background(), dir); err != nil {
		t.Fatal(err)
	}
	if alive(ours.Process.Pid, start) {
		t.Error("leftover process still running after Sweep")
	}
	// No pid file: nothing to do.
	if err := d.Sweep(context.Background(), t.TempDir()); err != nil {
		t.Error(err)
	}
}
