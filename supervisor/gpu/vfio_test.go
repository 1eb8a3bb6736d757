package gpu_test

import (
	"errors"
	"reflect"
	"strings"
	"syscall"
	"testing"

	"github.com/carrel-os/carrel/supervisor/gpu"
	"github.com/carrel-os/carrel/supervisor/gpu/gputest"
)

func TestBindAndRelease(t *testing.T) {
	h, s := fakeHost(t, gputest.NVIDIAWithAudio())
	p, err := h.Check([]string{gputest.NVIDIAGPU}, nil)
	if err != nil {
		t.Fatal(err)
	}
	moved, err := h.Bind(p.Addresses())
	if err != nil {
		t.Fatal(err)
	}
	if got := gpu.Strings(moved); !reflect.DeepEqual(got, []string{gputest.NVIDIAGPU, gputest.NVIDIAAudio}) {
		t.Errorf("moved %v", got)
	}
	for _, a := range []string{gputest.NVIDIAGPU, gputest.NVIDIAAudio} {
		if s.Driver(a) != "vfio-pci" || s.Override(a) != "vfio-pci" {
			t.Errorf("%s after Bind: driver %q, override %q", a, s.Driver(a), s.Override(a))
		}
	}
	if s.Driver(gputest.NVIDIAPort) != "pcieport" {
		t.Errorf("the root port was moved: %q", s.Driver(gputest.NVIDIAPort))
	}
	// libvirt's order: override, unbind from the old driver, probe.
	want := []string{
		"bus/pci/devices/0000:01:00.0/driver_override <- vfio-pci",
		"bus/pci/drivers/nvidia/unbind <- 0000:01:00.0",
		"bus/pci/drivers_probe <- 0000:01:00.0",
		"bus/pci/devices/0000:01:00.1/driver_override <- vfio-pci",
		"bus/pci/drivers/snd_hda_intel/unbind <- 0000:01:00.1",
		"bus/pci/drivers_probe <- 0000:01:00.1",
	}
	if got := s.Writes(); !reflect.DeepEqual(got, want) {
		t.Errorf("writes:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if err := h.Release(moved); err != nil {
		t.Fatal(err)
	}
	for a, drv := range map[string]string{gputest.NVIDIAGPU: "nvidia", gputest.NVIDIAAudio: "snd_hda_intel"} {
		if s.Driver(a) != drv || s.Override(a) != "" {
			t.Errorf("%s after Release: driver %q, override %q; want %s and none", a, s.Driver(a), s.Override(a), drv)
		}
	}
	// Releasing again changes nothing.
	n := len(s.Writes())
	if err := h.Release(moved); err != nil {
		t.Fatal(err)
	}
	for _, w := range s.Writes()[n:] {
		if !strings.HasPrefix(w, "bus/pci/drivers_probe") {
			t.Errorf("a second Release wrote %s", w)
		}
	}
	if s.Driver(gputest.NVIDIAGPU) != "nvidia" {
		t.Errorf("after a second Release: %q", s.Driver(gputest.NVIDIAGPU))
	}
}

// A device the operator bound to vfio-pci already (vfio-pci.ids=...) is
// used as it is and never given back to a host driver.
func TestBindLeavesVFIODevicesAlone(t *testing.T) {
	devs := gputest.NVIDIAWithAudio()
	devs[1].Driver, devs[1].Native = "vfio-pci", "nvidia"
	h, s := fakeHost(t, devs)
	moved, err := h.Bind([]gpu.Address{addr(t, gputest.NVIDIAGPU), addr(t, gputest.NVIDIAAudio)})
	if err != nil {
		t.Fatal(err)
	}
	if got := gpu.Strings(moved); !reflect.DeepEqual(got, []string{gputest.NVIDIAAudio}) {
		t.Errorf("moved %v; want the audio function only", got)
	}
	if err := h.Release(moved); err != nil {
		t.Fatal(err)
	}
	if s.Driver(gputest.NVIDIAGPU) != "vfio-pci" || s.Driver(gputest.NVIDIAAudio) != "snd_hda_intel" {
		t.Errorf("after Release: gpu on %q, audio on %q", s.Driver(gputest.NVIDIAGPU), s.Driver(gputest.NVIDIAAudio))
	}
}

func TestBindWithoutVFIOModule(t *testing.T) {
	h, s := fakeHost(t, gputest.NVIDIAWithAudio())
	s.RemoveDriver("vfio-pci")
	moved, err := h.Bind([]gpu.Address{addr(t, gputest.NVIDIAGPU)})
	if !errors.Is(err, gpu.ErrUnavailable) || !strings.Contains(err.Error(), "modprobe vfio-pci") || moved != nil {
		t.Errorf("Bind without vfio-pci = %v, %v", moved, err)
	}
	if w := s.Writes(); len(w) != 0 || s.Driver(gputest.NVIDIAGPU) != "nvidia" {
		t.Errorf("wrote %v; driver %q", w, s.Driver(gputest.NVIDIAGPU))
	}
}

// A driver that will not let go of the second device: the first is given
// back, and nothing is left on vfio-pci.
func TestBindRollsBack(t *testing.T) {
	h, s := fakeHost(t, gputest.NVIDIAWithAudio())
	s.Fail["bus/pci/drivers/snd_hda_intel/unbind"] = syscall.EBUSY
	moved, err := h.Bind([]gpu.Address{addr(t, gputest.NVIDIAGPU), addr(t, gputest.NVIDIAAudio)})
	if !errors.Is(err, gpu.ErrUnavailable) || !strings.Contains(err.Error(), "unbind 0000:01:00.1 from snd_hda_intel") || moved != nil {
		t.Fatalf("Bind = %v, %v", moved, err)
	}
	for a, drv := range map[string]string{gputest.NVIDIAGPU: "nvidia", gputest.NVIDIAAudio: "snd_hda_intel"} {
		if s.Driver(a) != drv || s.Override(a) != "" {
			t.Errorf("%s after a failed Bind: driver %q, override %q", a, s.Driver(a), s.Override(a))
		}
	}
}

// vfio-pci loaded but declining the device, and a probe that fails: the
// device is given back each time.
func TestBindNotTaken(t *testing.T) {
	h, s := fakeHost(t, gputest.IntelIntegrated())
	s.VFIODeclines = map[string]bool{gputest.IntelGPU: true}
	moved, err := h.Bind([]gpu.Address{addr(t, gputest.IntelGPU)})
	if !errors.Is(err, gpu.ErrUnavailable) || moved != nil || !strings.Contains(err.Error(), `0000:00:02.0 did not bind to vfio-pci (its driver is now "")`) {
		t.Errorf("Bind declined = %v, %v", moved, err)
	}
	if s.Driver(gputest.IntelGPU) != "i915" || s.Override(gputest.IntelGPU) != "" {
		t.Errorf("after a declined Bind: driver %q, override %q", s.Driver(gputest.IntelGPU), s.Override(gputest.IntelGPU))
	}
	s.VFIODeclines = nil
	s.Fail["bus/pci/drivers_probe"] = syscall.ENODEV
	moved, err = h.Bind([]gpu.Address{addr(t, gputest.IntelGPU)})
	if !errors.Is(err, gpu.ErrUnavailable) || moved != nil || !strings.Contains(err.Error(), "probe 0000:00:02.0") {
		t.Errorf("Bind with a failing probe = %v, %v", moved, err)
	}
	if s.Override(gputest.IntelGPU) != "" {
		t.Errorf("override left behind: %q", s.Override(gputest.IntelGPU))
	}
}

// An override someone else set after Bind is theirs: Release keeps it.
func TestReleaseKeepsOthersOverride(t *testing.T) {
	h, s := fakeHost(t, gputest.IntelIntegrated())
	moved, err := h.Bind([]gpu.Address{addr(t, gputest.IntelGPU)})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Write(s.Root+"/bus/pci/devices/"+gputest.IntelGPU+"/driver_override", []byte("pci-stub")); err != nil {
		t.Fatal(err)
	}
	if err := h.Release(moved); err != nil {
		t.Fatal(err)
	}
	if s.Override(gputest.IntelGPU) != "pci-stub" || s.Driver(gputest.IntelGPU) != "" {
		t.Errorf("after Release: override %q, driver %q", s.Override(gputest.IntelGPU), s.Driver(gputest.IntelGPU))
	}
}
