package gpu

import (
	"fmt"
	"slices"
)

// Plan is what handing a VM its GPUs takes.
type Plan struct {
	GPUs []GPU
	// Devices is every device the VM gets, each once, sorted: the GPUs
	// and the other functions of their slots.
	Devices []Device
}

// Addresses returns the addresses of p.Devices.
func (p Plan) Addresses() []Address {
	out := make([]Address, len(p.Devices))
	for i, d := range p.Devices {
		out[i] = d.Address
	}
	return out
}

// Check vets a VM's request for the GPUs at want. It refuses, saying why:
//   - a malformed or repeated address, no such device, or one that is not
//     a display controller (ErrInvalid);
//   - a host whose IOMMU is off, a GPU held by another VM (held maps each
//     other VM to the GPUs it was given; a GPU whose IOMMU group another
//     VM holds counts as held), and a GPU whose group holds devices that
//     would stay behind, named (ErrUnavailable).
func (h *Host) Check(want []string, held map[string][]string) (Plan, error) {
	addrs, err := ParseAddresses(want)
	if err != nil {
		return Plan{}, err
	}
	if len(addrs) == 0 {
		return Plan{}, nil
	}
	on, err := h.IOMMU()
	if err != nil {
		return Plan{}, err
	}
	if !on {
		return Plan{}, errIOMMUOff()
	}
	owner, groupOwner := h.holders(held)
	var p Plan
	seen := map[Address]bool{}
	for _, a := range addrs {
		g, err := h.GPU(a)
		if err != nil {
			return Plan{}, err
		}
		if o, ok := owner[a]; ok {
			return Plan{}, fmt.Errorf("%w: GPU %s is already assigned to VM %q", ErrUnavailable, a, o.vm)
		}
		if o, ok := groupOwner[g.IOMMUGroup]; ok && g.IOMMUGroup >= 0 {
			return Plan{}, fmt.Errorf("%w: GPU %s is in IOMMU group %d, which VM %q holds with its GPU %s", ErrUnavailable, a, g.IOMMUGroup, o.vm, o.gpu)
		}
		if !g.Assignable {
			return Plan{}, fmt.Errorf("%w: GPU %s cannot be assigned: %s (move the card to a slot whose group it has alone; see the ACS note in docs/operator-guide.md)", ErrUnavailable, a, g.Reason)
		}
		p.GPUs = append(p.GPUs, g)
		for _, d := range g.Passed() {
			if !seen[d.Address] {
				seen[d.Address] = true
				p.Devices = append(p.Devices, d)
			}
		}
	}
	slices.SortFunc(p.Devices, func(x, y Device) int { return compare(x.Address, y.Address) })
	return p, nil
}

type holder struct{ vm, gpu string }

// holders maps the GPUs other VMs hold, and their IOMMU groups, to the
// VM. A held GPU that is unreadable now (removed from the host) still
// holds its address.
func (h *Host) holders(held map[string][]string) (map[Address]holder, map[int]holder) {
	owner := map[Address]holder{}
	groups := map[int]holder{}
	for vm, gpus := range held {
		for _, s := range gpus {
			a, err := ParseAddress(s)
			if err != nil {
				continue
			}
			o := holder{vm: vm, gpu: a.String()}
			owner[a] = o
			if d, err := h.device(a); err == nil && d.IOMMUGroup >= 0 {
				groups[d.IOMMUGroup] = o
			}
		}
	}
	return owner, groups
}
