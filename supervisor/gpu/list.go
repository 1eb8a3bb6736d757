package gpu

import (
	"errors"
	"fmt"
	"strings"
)

// Role says what becomes of a group member when its GPU is assigned.
type Role string

const (
	// RolePassed: a function of the GPU's slot; it goes to the VM too.
	RolePassed Role = "passed"
	// RoleBridge: a bridge; it stays with the host, as VFIO allows.
	RoleBridge Role = "bridge"
	// RoleBlocking: an unrelated endpoint; the GPU cannot be assigned.
	RoleBlocking Role = "blocking"
)

// Member is another device in a GPU's IOMMU group.
type Member struct {
	Device
	Role Role
}

// GPU is a display controller and what assigning it would take.
type GPU struct {
	Device
	// Name is the vendor's and model's name from pci.ids, or the vendor's
	// alone, or "".
	Name string
	// Group holds the other devices of its IOMMU group.
	Group []Member
	// Assignable says whether the whole group can go to a VM; Reason says
	// why not.
	Assignable bool
	Reason     string
}

// Passed returns the devices a VM gets with the GPU: the GPU, then the
// other functions of its slot.
func (g GPU) Passed() []Device {
	out := []Device{g.Device}
	for _, m := range g.Group {
		if m.Role == RolePassed {
			out = append(out, m.Device)
		}
	}
	return out
}

// Inventory is what List finds.
type Inventory struct {
	// IOMMU is false when the host has no IOMMU groups; no GPU is then
	// assignable.
	IOMMU bool
	GPUs  []GPU
}

// List returns the host's display controllers, sorted by address.
func (h *Host) List() (Inventory, error) {
	var inv Inventory
	on, err := h.IOMMU()
	if err != nil {
		return inv, err
	}
	inv.IOMMU = on
	addrs, err := h.addresses()
	if err != nil {
		return inv, err
	}
	for _, a := range addrs {
		d, err := h.device(a)
		if err != nil {
			return inv, err
		}
		if !d.IsDisplay() {
			continue
		}
		g, err := h.inspect(d, on)
		if err != nil {
			return inv, err
		}
		inv.GPUs = append(inv.GPUs, g)
	}
	h.name(inv.GPUs)
	return inv, nil
}

// GPU returns the display controller at a, with its group and whether it
// can be assigned. It is ErrInvalid when there is no such device or it is
// not a display controller.
func (h *Host) GPU(a Address) (GPU, error) {
	on, err := h.IOMMU()
	if err != nil {
		return GPU{}, err
	}
	d, err := h.device(a)
	if err != nil {
		return GPU{}, err
	}
	if !d.IsDisplay() {
		return GPU{}, fmt.Errorf("%w: %s is not a display controller: %s", ErrInvalid, a, d.Describe())
	}
	return h.inspect(d, on)
}

// inspect reads d's IOMMU group and applies the rule in the package doc.
func (h *Host) inspect(d Device, iommu bool) (GPU, error) {
	g := GPU{Device: d}
	switch {
	case !iommu:
		g.Reason = "the IOMMU is off"
		return g, nil
	case d.IOMMUGroup < 0:
		g.Reason = "it has no IOMMU group"
		return g, nil
	case d.Bridge:
		g.Reason = "it is a bridge, not an endpoint"
		return g, nil
	}
	members, err := h.groupMembers(d.IOMMUGroup)
	if err != nil {
		return g, err
	}
	var blocking []string
	for _, a := range members {
		if a == d.Address {
			continue
		}
		md, err := h.device(a)
		if errors.Is(err, ErrInvalid) {
			continue // gone since the group was read
		}
		if err != nil {
			return g, err
		}
		m := Member{Device: md}
		switch {
		case md.Bridge:
			m.Role = RoleBridge
		case a.SameSlot(d.Address):
			m.Role = RolePassed
		default:
			m.Role = RoleBlocking
			blocking = append(blocking, md.Describe())
		}
		g.Group = append(g.Group, m)
	}
	if len(blocking) > 0 {
		g.Reason = fmt.Sprintf("IOMMU group %d also holds %s, which would stay behind: all endpoint devices of a group must go to the same VM", d.IOMMUGroup, strings.Join(blocking, ", "))
		return g, nil
	}
	g.Assignable = true
	return g, nil
}
