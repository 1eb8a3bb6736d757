package gpu

import "libvirt.org/go/libvirtxml"

// DomainHostdevs returns a libvirt <hostdev> for each device: a PCI
// subsystem hostdev with managed='yes', so that libvirt binds the device
// to vfio-pci before the domain starts and gives it back to its host
// driver after, and the device's host address as its source. The guest
// address is left to libvirt. Pass every device of a Plan (Plan.Devices),
// not only the GPUs: a GPU whose slot's other functions stay behind
// leaves its IOMMU group unusable.
func DomainHostdevs(devs []Address) []libvirtxml.DomainHostdev {
	out := make([]libvirtxml.DomainHostdev, 0, len(devs))
	for _, a := range devs {
		domain, bus, slot, fn := uint(a.Domain), uint(a.Bus), uint(a.Slot), uint(a.Function)
		out = append(out, libvirtxml.DomainHostdev{
			Managed: "yes",
			SubsysPCI: &libvirtxml.DomainHostdevSubsysPCI{
				Driver: &libvirtxml.DomainHostdevSubsysPCIDriver{Name: "vfio"},
				Source: &libvirtxml.DomainHostdevSubsysPCISource{
					Address: &libvirtxml.DomainAddressPCI{Domain: &domain, Bus: &bus, Slot: &slot, Function: &fn},
				},
			},
		})
	}
	return out
}

// Hostdevs vets gpus as a boot must (Check, with no other VM's holdings:
// those were vetted when the VM was created) and returns the hostdevs for
// every device of their groups that goes to the VM. The libvirt driver
// puts them in the domain's <devices>; libvirt binds them itself.
func (h *Host) Hostdevs(gpus []string) ([]libvirtxml.DomainHostdev, error) {
	p, err := h.Check(gpus, nil)
	if err != nil {
		return nil, err
	}
	return DomainHostdevs(p.Addresses()), nil
}
