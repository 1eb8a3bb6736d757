package gpu_test

import (
	"encoding/xml"
	"errors"
	"strings"
	"testing"

	"libvirt.org/go/libvirtxml"

	"github.com/carrel-os/carrel/supervisor/gpu"
	"github.com/carrel-os/carrel/supervisor/gpu/gputest"
)

func TestDomainHostdevsXML(t *testing.T) {
	h, _ := fakeHost(t, gputest.NVIDIAWithAudio())
	hds, err := h.Hostdevs([]string{gputest.NVIDIAGPU})
	if err != nil {
		t.Fatal(err)
	}
	dom := libvirtxml.Domain{Type: "kvm", Name: "carrel-a", Devices: &libvirtxml.DomainDeviceList{Hostdevs: hds}}
	got, err := dom.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	want := `<domain type="kvm">
  <name>carrel-a</name>
  <devices>
    <hostdev mode="subsystem" type="pci" managed="yes">
      <driver name="vfio"></driver>
      <source>
        <address domain="0x0000" bus="0x01" slot="0x00" function="0x0"></address>
      </source>
    </hostdev>
    <hostdev mode="subsystem" type="pci" managed="yes">
      <driver name="vfio"></driver>
      <source>
        <address domain="0x0000" bus="0x01" slot="0x00" function="0x1"></address>
      </source>
    </hostdev>
  </devices>
</domain>`
	if got != want {
		t.Errorf("domain XML:\n%s\nwant:\n%s", got, want)
	}
	// libvirt reads it back to the same devices.
	var back libvirtxml.Domain
	if err := xml.Unmarshal([]byte(got), &back); err != nil {
		t.Fatal(err)
	}
	if n := len(back.Devices.Hostdevs); n != 2 || back.Devices.Hostdevs[1].SubsysPCI == nil || *back.Devices.Hostdevs[1].SubsysPCI.Source.Address.Function != 1 {
		t.Errorf("read back %d hostdevs: %+v", n, back.Devices.Hostdevs)
	}
}

func TestDomainHostdevsWideDomain(t *testing.T) {
	a, err := gpu.ParseAddress("10000:e1:1f.7")
	if err != nil {
		t.Fatal(err)
	}
	hd := gpu.DomainHostdevs([]gpu.Address{a})[0]
	b, err := xml.Marshal(&hd)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), `<address domain="0x10000" bus="0xe1" slot="0x1f" function="0x7">`) {
		t.Errorf("hostdev XML: %s", b)
	}
}

func TestHostdevsRefuse(t *testing.T) {
	h, _ := fakeHost(t, gputest.AMDSharingNIC())
	if hds, err := h.Hostdevs([]string{gputest.AMDGPU}); !errors.Is(err, gpu.ErrUnavailable) || hds != nil {
		t.Errorf("Hostdevs of a GPU sharing its group = %v, %v", hds, err)
	}
}
