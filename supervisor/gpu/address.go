package gpu

import (
	"fmt"
	"strconv"
	"strings"
)

// Address is a PCI device's address: domain, bus, slot (device) and
// function.
type Address struct {
	Domain   uint32
	Bus      uint8
	Slot     uint8 // 0 to 0x1f
	Function uint8 // 0 to 7
}

// ParseAddress reads an address in the kernel's form, DOMAIN:BUS:SLOT.FUNC
// in hex ("0000:41:00.0"): a domain of 4 to 8 digits, a bus and a slot of
// 2, a function of 1. Upper-case hex is accepted; String writes lower case.
// The short form lspci prints ("41:00.0") is not: callers that take it
// (the CLI) add the domain themselves, so that the API has one spelling.
func ParseAddress(s string) (Address, error) {
	bad := func(why string) (Address, error) {
		return Address{}, fmt.Errorf("%w: PCI address %.40q: %s (want DOMAIN:BUS:SLOT.FUNC, e.g. 0000:41:00.0)", ErrInvalid, s, why)
	}
	dom, rest, ok := strings.Cut(s, ":")
	if !ok {
		return bad("no domain")
	}
	bus, rest, ok := strings.Cut(rest, ":")
	if !ok {
		return bad("no bus")
	}
	slot, fn, ok := strings.Cut(rest, ".")
	if !ok {
		return bad("no function")
	}
	if len(dom) < 4 || len(dom) > 8 || len(bus) != 2 || len(slot) != 2 || len(fn) != 1 {
		return bad("wrong number of digits")
	}
	d, err1 := parseHex(dom, 32)
	b, err2 := parseHex(bus, 8)
	sl, err3 := parseHex(slot, 8)
	f, err4 := parseHex(fn, 8)
	if err1 != nil || err2 != nil || err3 != nil || err4 != nil {
		return bad("not hexadecimal")
	}
	if sl > 0x1f {
		return bad("slot over 1f")
	}
	if f > 7 {
		return bad("function over 7")
	}
	return Address{Domain: uint32(d), Bus: uint8(b), Slot: uint8(sl), Function: uint8(f)}, nil
}

// parseHex parses digits only: strconv would also take a sign or "0x".
func parseHex(s string, bits int) (uint64, error) {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F') {
			return 0, strconv.ErrSyntax
		}
	}
	return strconv.ParseUint(s, 16, bits)
}

// String is the kernel's spelling, as in /sys/bus/pci/devices.
func (a Address) String() string {
	return fmt.Sprintf("%04x:%02x:%02x.%x", a.Domain, a.Bus, a.Slot, a.Function)
}

// SameSlot reports whether a and b are functions of one device.
func (a Address) SameSlot(b Address) bool {
	return a.Domain == b.Domain && a.Bus == b.Bus && a.Slot == b.Slot
}

// Less orders addresses numerically.
func (a Address) Less(b Address) bool {
	if a.Domain != b.Domain {
		return a.Domain < b.Domain
	}
	if a.Bus != b.Bus {
		return a.Bus < b.Bus
	}
	if a.Slot != b.Slot {
		return a.Slot < b.Slot
	}
	return a.Function < b.Function
}

// compare is Less as a three-way comparison, for slices.SortFunc.
func compare(a, b Address) int {
	switch {
	case a.Less(b):
		return -1
	case b.Less(a):
		return 1
	}
	return 0
}

// MaxGPUs caps the GPUs one VM may ask for.
const MaxGPUs = 16

// ParseAddresses parses a request's addresses, refusing repeats (in any
// spelling) and more than MaxGPUs.
func ParseAddresses(ss []string) ([]Address, error) {
	if len(ss) > MaxGPUs {
		return nil, fmt.Errorf("%w: %d GPUs asked for, at most %d", ErrInvalid, len(ss), MaxGPUs)
	}
	out := make([]Address, 0, len(ss))
	seen := map[Address]bool{}
	for _, s := range ss {
		a, err := ParseAddress(s)
		if err != nil {
			return nil, err
		}
		if seen[a] {
			return nil, fmt.Errorf("%w: GPU %s asked for twice", ErrInvalid, a)
		}
		seen[a] = true
		out = append(out, a)
	}
	return out, nil
}

// Canonical returns the addresses in the kernel's spelling, in the order
// given, or the first error of ParseAddresses.
func Canonical(ss []string) ([]string, error) {
	as, err := ParseAddresses(ss)
	if err != nil {
		return nil, err
	}
	out := make([]string, len(as))
	for i, a := range as {
		out[i] = a.String()
	}
	return out, nil
}
