package qemu

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/supervisor/driver"
	"github.com/carrel-os/carrel/supervisor/gpu"
	"github.com/carrel-os/carrel/supervisor/gpu/gputest"
)

func TestVFIOArgs(t *testing.T) {
	var devs []gpu.Address
	for _, s := range []string{"0000:01:00.0", "0000:01:00.1", "0000:02:00.0"} {
		a, err := gpu.ParseAddress(s)
		if err != nil {
			t.Fatal(err)
		}
		devs = append(devs, a)
	}
	want := []string{
		"-device", "pcie-root-port,id=carrel-rp0,bus=pcie.0,chassis=1",
		"-device", "vfio-pci,host=0000:01:00.0,id=carrel-hostdev0,bus=carrel-rp0,addr=00.0,multifunction=on",
		"-device", "vfio-pci,host=0000:01:00.1,id=carrel-hostdev1,bus=carrel-rp0,addr=00.1",
		"-device", "pcie-root-port,id=carrel-rp1,bus=pcie.0,chassis=2",
		"-device", "vfio-pci,host=0000:02:00.0,id=carrel-hostdev2,bus=carrel-rp1,addr=00.0",
	}
	if got := vfioArgs(devs); !reflect.DeepEqual(got, want) {
		t.Errorf("vfioArgs:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if got := vfioArgs(nil); len(got) != 0 {
		t.Errorf("no devices: %v", got)
	}
}

// fakeQEMU is a "QEMU" that writes its arguments, one a line, beside
// itself and exits at once, as a QEMU that rejects its command line does.
func fakeQEMU(t *testing.T) (bin, argv string) {
	t.Helper()
	dir := t.TempDir()
	bin = filepath.Join(dir, "qemu-system-x86_64")
	script := "#!/bin/sh\nprintf '%s\\n' \"$@\" > \"$(dirname \"$0\")/argv\"\necho 'vfio: fake qemu gives up' >&2\nexit 1\n"
	if err := os.WriteFile(bin, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return bin, filepath.Join(dir, "argv")
}

// A start with a GPU binds its group to vfio-pci, asks QEMU for q35 and
// the devices, and, when QEMU does not come up, gives them back.
func TestStartWithGPU(t *testing.T) {
	t.Log("fake sysfs tree and a fake QEMU: real VFIO passthrough is not exercised here")
	s := gputest.New(t, gputest.Drivers...)
	s.Add(gputest.NVIDIAWithAudio()...)
	bin, argvFile := fakeQEMU(t)
	d := New(Config{Binary: bin, Accelerator: "kvm", Machine: MachineMicroVM, GPUs: gpu.New(gpu.Config{Sysfs: s.Root, Write: s.Write})})
	spec := testSpec(t.TempDir())
	spec.GPUs = []string{gputest.NVIDIAGPU}
	_, err := d.Start(context.Background(), spec)
	if err == nil || !strings.Contains(err.Error(), "fake qemu gives up") {
		t.Fatalf("Start = %v, want the fake QEMU's complaint", err)
	}
	b, err := os.ReadFile(argvFile)
	if err != nil {
		t.Fatal(err)
	}
	argv := strings.Split(strings.TrimSpace(string(b)), "\n")
	if m := argValue(argv, "-machine"); len(m) != 1 || m[0] != "q35,accel=kvm" {
		t.Errorf("machine %v; a VM with GPUs needs q35", m)
	}
	devs := argValue(argv, "-device")
	for _, want := range []string{
		"vfio-pci,host=0000:01:00.0,id=carrel-hostdev0,bus=carrel-rp0,addr=00.0,multifunction=on",
		"vfio-pci,host=0000:01:00.1,id=carrel-hostdev1,bus=carrel-rp0,addr=00.1",
	} {
		if !slices.Contains(devs, want) {
			t.Errorf("no -device %s in %v", want, devs)
		}
	}
	if slices.ContainsFunc(devs, func(s string) bool { return strings.Contains(s, gputest.NVIDIAPort) }) {
		t.Errorf("the root port (a bridge) was passed through: %v", devs)
	}
	// Bound before QEMU started, given back after it failed.
	w := strings.Join(s.Writes(), "\n")
	if !strings.Contains(w, "bus/pci/drivers/nvidia/unbind <- 0000:01:00.0") || !strings.Contains(w, "bus/pci/drivers/vfio-pci/unbind <- 0000:01:00.0") {
		t.Errorf("writes:\n%s", w)
	}
	for a, drv := range map[string]string{gputest.NVIDIAGPU: "nvidia", gputest.NVIDIAAudio: "snd_hda_intel"} {
		if s.Driver(a) != drv || s.Override(a) != "" {
			t.Errorf("%s after a failed start: driver %q, override %q", a, s.Driver(a), s.Override(a))
		}
	}
	if _, err := os.Stat(filepath.Join(spec.Dir, vfioFileName)); !os.IsNotExist(err) {
		t.Errorf("the list of moved devices outlived the failed start: %v", err)
	}
}

// A GPU the host cannot hand over fails the start before QEMU runs, with
// the reason, and nothing is bound.
func TestStartRefusesUnassignableGPU(t *testing.T) {
	s := gputest.New(t, gputest.Drivers...)
	s.Add(gputest.AMDSharingNIC()...)
	bin, argvFile := fakeQEMU(t)
	d := New(Config{Binary: bin, Accelerator: "tcg", GPUs: gpu.New(gpu.Config{Sysfs: s.Root, Write: s.Write})})
	spec := testSpec(t.TempDir())
	spec.GPUs = []string{gputest.AMDGPU}
	_, err := d.Start(context.Background(), spec)
	if !errors.Is(err, gpu.ErrUnavailable) || !strings.Contains(err.Error(), "0000:04:00.0") {
		t.Fatalf("Start = %v, want ErrUnavailable naming the NIC", err)
	}
	if _, err := os.Stat(argvFile); err == nil {
		t.Error("QEMU ran")
	}
	if w := s.Writes(); len(w) != 0 {
		t.Errorf("wrote %v", w)
	}
}

// Kill gives a VM's devices back once its QEMU is gone (here, long gone).
func TestKillGivesGPUsBack(t *testing.T) {
	s := gputest.New(t, gputest.Drivers...)
	s.Add(gputest.NVIDIAWithAudio()...)
	h := gpu.New(gpu.Config{Sysfs: s.Root, Write: s.Write})
	p, err := h.Check([]string{gputest.NVIDIAGPU}, nil)
	if err != nil {
		t.Fatal(err)
	}
	moved, err := h.Bind(p.Addresses())
	if err != nil {
		t.Fatal(err)
	}
	d := New(Config{Accelerator: "tcg", GPUs: h})
	if err := d.Kill(context.Background(), driver.Instance{PID: 0, VFIO: gpu.Strings(moved)}); err != nil {
		t.Fatal(err)
	}
	if s.Driver(gputest.NVIDIAGPU) != "nvidia" || s.Driver(gputest.NVIDIAAudio) != "snd_hda_intel" {
		t.Errorf("after Kill: %q, %q", s.Driver(gputest.NVIDIAGPU), s.Driver(gputest.NVIDIAAudio))
	}
}

// TestSweepGivesBackGPUsOfAnInterruptedStart: a carreld that died after
// a start bound its VM's devices to vfio-pci, before the VM's record had
// them, leaves them listed in the VM's directory; Sweep, at the next
// start, gives them back. A device that was on vfio-pci before (an
// operator's) is not listed, and keeps vfio-pci.
func TestSweepGivesBackGPUsOfAnInterruptedStart(t *testing.T) {
	t.Log("fake sysfs tree: real VFIO passthrough is not exercised here")
	s := gputest.New(t, gputest.Drivers...)
	s.Add(gputest.NVIDIAWithAudio()...)
	h := gpu.New(gpu.Config{Sysfs: s.Root, Write: s.Write})
	// The operator bound the audio function to vfio-pci beforehand.
	pre, err := gpu.ParseAddresses([]string{gputest.NVIDIAAudio})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.Bind(pre); err != nil {
		t.Fatal(err)
	}
	d := New(Config{Accelerator: "tcg", GPUs: h})
	spec := testSpec(t.TempDir())
	spec.GPUs = []string{gputest.NVIDIAGPU}
	l, err := newLayout(spec.Dir)
	if err != nil {
		t.Fatal(err)
	}
	plan, err := d.bindGPUs(spec, l) // ... and carreld died here
	if err != nil {
		t.Fatal(err)
	}
	if got := gpu.Strings(plan.moved); len(got) != 1 || got[0] != gputest.NVIDIAGPU {
		t.Fatalf("moved %v, want the GPU alone", got)
	}
	if b, err := os.ReadFile(l.vfio); err != nil || strings.TrimSpace(string(b)) != gputest.NVIDIAGPU {
		t.Fatalf("%s: %q, %v", l.vfio, b, err)
	}
	if s.Driver(gputest.NVIDIAGPU) != gpu.VFIODriver {
		t.Fatalf("the GPU is on %q", s.Driver(gputest.NVIDIAGPU))
	}
	if err := d.Sweep(context.Background(), spec.Dir); err != nil {
		t.Fatal(err)
	}
	if s.Driver(gputest.NVIDIAGPU) != "nvidia" || s.Override(gputest.NVIDIAGPU) != "" {
		t.Errorf("the GPU after Sweep: driver %q, override %q", s.Driver(gputest.NVIDIAGPU), s.Override(gputest.NVIDIAGPU))
	}
	if s.Driver(gputest.NVIDIAAudio) != gpu.VFIODriver {
		t.Errorf("the operator's device left vfio-pci: %q", s.Driver(gputest.NVIDIAAudio))
	}
	if _, err := os.Stat(l.vfio); !os.IsNotExist(err) {
		t.Errorf("%s is still there: %v", l.vfio, err)
	}
	// A damaged list is an error, not a guess.
	if err := os.WriteFile(l.vfio, []byte("not-an-address\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := d.Sweep(context.Background(), spec.Dir); err == nil {
		t.Error("Sweep took a damaged list")
	}
}
