package tests

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"libvirt.org/go/libvirtxml"

	"github.com/carrel-os/carrel/supervisor/accel"
	"github.com/carrel-os/carrel/supervisor/driver/libvirt"
	"github.com/carrel-os/carrel/supervisor/driver/libvirt/libvirttest"
	"github.com/carrel-os/carrel/tests/harness"
)

// TestLibvirtDriver runs the operator's flow with the libvirt driver, chosen
// in carreld's config file: the VM is a libvirt domain that virsh shows,
// under carrel's host limits, carreld re-adopts it after a kill -9, stop
// removes it, and a domain that is not carrel's, though named like one, is
// left alone throughout.
func TestLibvirtDriver(t *testing.T) {
	harness.StartLibvirt(t)
	config := filepath.Join(t.TempDir(), "carreld.json")
	if err := os.WriteFile(config, []byte(`{"driver": "libvirt", "libvirt-uri": "`+harness.LibvirtURI+`"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	d := harness.New(t, "--config", config)
	d.Start()
	d.BuildImage()

	// Names unique to this run: libvirtd is shared by every test and run.
	var b [3]byte
	rand.Read(b[:])
	vmName, foreignVM := "lv"+hex.EncodeToString(b[:]), "lvf"+hex.EncodeToString(b[:])
	dom, foreign := libvirt.DomainName(vmName), libvirt.DomainName(foreignVM)
	t.Cleanup(func() {
		harness.Virsh("destroy", dom)
		harness.Virsh("destroy", foreign)
		harness.Virsh("undefine", foreign)
	})
	defineForeign(t, foreign)

	d.Must("vm", "create", vmName, "--image", "dev", "--memory", "512M", "--cpus", "1")
	v, ok := vmNamed(t, d, vmName)
	if !ok || v.State != "VM_STATE_RUNNING" || v.AgentState != "AGENT_STATE_READY" || v.Pid == 0 {
		t.Fatalf("after create: %+v", v)
	}
	if !strings.Contains(harness.MustVirsh(t, "list", "--name"), dom) {
		t.Fatalf("virsh list does not show %s", dom)
	}
	uuid := harness.MustVirsh(t, "domuuid", dom)
	if meta, err := harness.Virsh("metadata", dom, libvirt.MetadataNS); err != nil || !strings.Contains(meta, `name="`+vmName+`"`) {
		t.Errorf("carrel metadata of %s: %q %v", dom, meta, err)
	}
	if ifs := harness.MustVirsh(t, "domiflist", dom); strings.Contains(ifs, "network") || strings.Contains(ifs, "bridge") {
		t.Errorf("the domain has a nic:\n%s", ifs)
	}
	// QEMU runs as libvirt's unprivileged user, under its seccomp filter.
	status, err := os.ReadFile("/proc/" + strconv.Itoa(v.Pid) + "/status")
	if err != nil || !strings.Contains(string(status), "Seccomp:\t2") || strings.Contains(string(status), "Uid:\t0\t") {
		t.Errorf("qemu %d: %v\n%s", v.Pid, err, status)
	}

	// Host limits, through libvirt, on the domain's cgroup: 512 MiB and
	// QEMU's overhead (1.5 GiB under TCG, 512 MiB under KVM), one vCPU and
	// one CPU more.
	overhead := uint64(1536 << 20)
	if accelOf(t, d) == "kvm" {
		overhead = 512 << 20
	}
	if mt := harness.MustVirsh(t, "memtune", dom); !strings.Contains(mt, fmt.Sprintf("hard_limit     : %d\n", (512<<10)+overhead>>10)) {
		t.Errorf("virsh memtune %s:\n%s", dom, mt)
	}
	if l, err := libvirttest.ReadLimits(v.Pid); err != nil || l.MemoryBytes != (512<<20)+overhead || l.CPUQuota != 200000 || l.CPUPeriod != 100000 {
		t.Errorf("cgroup limits of qemu %d: %+v, %v", v.Pid, l, err)
	}

	if out := d.Must("exec", vmName, "--", "uname", "-a"); !strings.HasPrefix(out, "Linux carrel ") {
		t.Errorf("uname -a = %q", out)
	}
	checkGuestCPU(t, d, vmName)
	r := d.Carrel("exec", vmName, "--", "sh", "-c", "echo out; echo err >&2; exit 3")
	if r.Code != 3 || r.Stdout != "out\n" || r.Stderr != "err\n" {
		t.Errorf("exit/streams: %+v", r)
	}

	t.Run("carreld crash re-adopts the domain", func(t *testing.T) {
		d.Must("exec", vmName, "--", "sh", "-c", "echo survived > /workspace/marker")
		d.Kill()
		if got := harness.MustVirsh(t, "domstate", dom); got != "running" {
			t.Fatalf("after carreld was killed: domain is %q", got)
		}
		d.Start()
		after, _ := vmNamed(t, d, vmName)
		if after.State != "VM_STATE_RUNNING" || after.Pid != v.Pid {
			t.Fatalf("after restart: %+v (before %+v)", after, v)
		}
		if got := harness.MustVirsh(t, "domuuid", dom); got != uuid {
			t.Errorf("domain uuid %s, was %s: not the same domain", got, uuid)
		}
		if out := d.Must("exec", vmName, "--", "cat", "/workspace/marker"); out != "survived\n" {
			t.Errorf("marker = %q", out)
		}
	})

	t.Run("snapshot, restore and fork", func(t *testing.T) {
		d.Must("exec", vmName, "-d", "--", "sh", "-c", counter)
		deadline := time.Now().Add(30 * time.Second)
		for d.Carrel("exec", vmName, "--", "test", "-s", "/tmp/count").Code != 0 {
			if time.Now().After(deadline) {
				t.Fatal("the counter never started")
			}
			time.Sleep(200 * time.Millisecond)
		}
		d.Must("exec", vmName, "--", "sh", "-c", "echo before > /workspace/before")
		atSnapshot := count(t, d, vmName)
		d.Must("vm", "snapshot", vmName, "--name", "s1")
		if got := harness.MustVirsh(t, "domstate", dom); got != "running" {
			t.Errorf("after the snapshot: domain is %q", got)
		}
		d.Must("exec", vmName, "--", "sh", "-c", "echo later > /workspace/later")
		time.Sleep(5 * time.Second)
		later := count(t, d, vmName)

		before := harness.MustVirsh(t, "domuuid", dom)
		d.Must("vm", "restore", vmName, "s1")
		if got := count(t, d, vmName); got < atSnapshot || got >= later {
			t.Errorf("after restore the count is %d; it was %d at the snapshot and %d before the restore", got, atSnapshot, later)
		}
		if r := d.Carrel("exec", vmName, "--", "test", "-e", "/workspace/later"); r.Code != 1 {
			t.Errorf("a file written after the snapshot is there after the restore: %+v", r)
		}
		if out := d.Must("exec", vmName, "--", "cat", "/workspace/before"); out != "before\n" {
			t.Errorf("a file written before the snapshot: %q", out)
		}
		if got := harness.MustVirsh(t, "domuuid", dom); got == before {
			t.Error("the restored domain kept the old uuid")
		}

		fork := vmName + "b"
		t.Cleanup(func() { harness.Virsh("destroy", libvirt.DomainName(fork)) })
		d.Must("vm", "fork", vmName, fork, "--snapshot", "s1")
		if got := harness.MustVirsh(t, "domstate", libvirt.DomainName(fork)); got != "running" {
			t.Errorf("fork domain is %q", got)
		}
		d.Must("exec", fork, "--", "sh", "-c", "echo b > /workspace/only-b")
		if r := d.Carrel("exec", vmName, "--", "test", "-e", "/workspace/only-b"); r.Code != 1 {
			t.Errorf("the parent sees the fork's file: %+v", r)
		}
		if a, b := d.Must("exec", vmName, "--", "cat", "/proc/sys/kernel/random/uuid"), d.Must("exec", fork, "--", "cat", "/proc/sys/kernel/random/uuid"); a == b {
			t.Errorf("parent and fork draw the same uuid %q", a)
		}
		d.Must("vm", "rm", "--force", fork)
		d.Must("vm", "snapshot", "rm", vmName, "s1")
	})

	t.Run("a foreign domain of the same name stops a create", func(t *testing.T) {
		r := d.Carrel("vm", "create", foreignVM, "--image", "dev", "--memory", "256M")
		if r.Code == 0 || !strings.Contains(r.Stderr, foreign) {
			t.Errorf("create over a foreign domain: %+v", r)
		}
		if _, ok := vmNamed(t, d, foreignVM); ok {
			t.Error("the failed vm is listed")
		}
	})

	t.Run("stop removes the domain, start makes a new one", func(t *testing.T) {
		d.Must("vm", "stop", vmName)
		if st, _ := vmNamed(t, d, vmName); st.State != "VM_STATE_STOPPED" {
			t.Errorf("after stop: %+v", st)
		}
		if all := harness.MustVirsh(t, "list", "--all", "--name"); strings.Contains(all, dom) {
			t.Errorf("domain still defined after stop:\n%s", all)
		}
		d.Must("vm", "start", vmName)
		if out := d.Must("exec", vmName, "--", "echo", "back"); out != "back\n" {
			t.Errorf("after start: %q", out)
		}
		if got := harness.MustVirsh(t, "domuuid", dom); got == uuid {
			t.Error("start reused the old domain's uuid")
		}
	})

	t.Run("a domain that vanished while carreld was down is recorded", func(t *testing.T) {
		d.Kill()
		harness.MustVirsh(t, "destroy", dom)
		d.Start()
		st, _ := vmNamed(t, d, vmName)
		if st.State != "VM_STATE_STOPPED" || st.Pid != 0 || !strings.Contains(st.LastError, "while carreld was down") {
			t.Errorf("after restart: %+v", st)
		}
		d.Must("vm", "rm", vmName)
	})

	if got := harness.MustVirsh(t, "domstate", foreign); got != "shut off" {
		t.Errorf("foreign domain %s is %q, want still defined and shut off", foreign, got)
	}
	if meta, err := harness.Virsh("metadata", foreign, libvirt.MetadataNS); err == nil && meta != "" {
		t.Errorf("foreign domain got carrel metadata: %q", meta)
	}
}

// defineForeign defines a persistent domain as another tool would: no
// carrel metadata, never started.
func defineForeign(t *testing.T, name string) {
	t.Helper()
	x, err := (&libvirtxml.Domain{
		Type:   "qemu",
		Name:   name,
		Memory: &libvirtxml.DomainMemory{Value: 64, Unit: "MiB"},
		OS:     &libvirtxml.DomainOS{Type: &libvirtxml.DomainOSType{Arch: "x86_64", Type: "hvm"}},
	}).Marshal()
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "foreign.xml")
	if err := os.WriteFile(path, []byte(x), 0o600); err != nil {
		t.Fatal(err)
	}
	harness.MustVirsh(t, "define", path)
}

// accelOf is the accelerator carreld's VMs get (carrel info).
func accelOf(t *testing.T, d *harness.Daemon) string {
	t.Helper()
	var info struct {
		Accelerator string `json:"accelerator"`
	}
	if err := json.Unmarshal([]byte(d.Must("info")), &info); err != nil || info.Accelerator == "" {
		t.Fatalf("carrel info: %+v, %v", info, err)
	}
	return info.Accelerator
}

// checkGuestCPU checks the CPU the guest of vm sees: under TCG, QEMU's
// "max" model without the features TCG runs slowly (accel.TCGHiddenFeatures);
// under KVM, the host's CPU, which is not checked here.
func checkGuestCPU(t *testing.T, d *harness.Daemon, vm string) {
	t.Helper()
	if accelOf(t, d) != accel.TCG {
		return
	}
	flags := strings.Fields(d.Must("exec", vm, "--", "sh", "-c", `grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2`))
	for _, f := range accel.TCGHiddenFeatures {
		if slices.Contains(flags, f) {
			t.Errorf("the guest sees %s under TCG: %v", f, flags)
		}
	}
	// Still the max model: features qemu64 lacks are there.
	for _, f := range []string{"sse4_2", "avx2"} {
		if !slices.Contains(flags, f) {
			t.Errorf("the guest lacks %s under TCG: %v", f, flags)
		}
	}
}
