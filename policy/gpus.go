package policy

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// MaxGPUs caps the GPUs an api input names.
const MaxGPUs = 16

// normalizeGPUs puts the PCI addresses of GPUs in the one form rules
// compare, the kernel's (DOMAIN:BUS:SLOT.FUNC, lower-case hex, a domain of
// at least four digits: "0000:41:00.0"), sorted, each once. It accepts
// exactly what supervisor/gpu.ParseAddress accepts.
func normalizeGPUs(gpus []string) ([]string, error) {
	if len(gpus) > MaxGPUs {
		return nil, fmt.Errorf("%w: %d GPUs, limit %d", ErrInvalidInput, len(gpus), MaxGPUs)
	}
	if len(gpus) == 0 {
		return nil, nil
	}
	out := make([]string, 0, len(gpus))
	for _, s := range gpus {
		c, ok := canonicalPCI(s)
		if !ok {
			return nil, fmt.Errorf("%w: GPU address %.40q (want DOMAIN:BUS:SLOT.FUNC, e.g. 0000:41:00.0)", ErrInvalidInput, s)
		}
		out = append(out, c)
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

func canonicalPCI(s string) (string, bool) {
	dom, rest, ok1 := strings.Cut(s, ":")
	bus, rest, ok2 := strings.Cut(rest, ":")
	slot, fn, ok3 := strings.Cut(rest, ".")
	if !ok1 || !ok2 || !ok3 || len(dom) < 4 || len(dom) > 8 || len(bus) != 2 || len(slot) != 2 || len(fn) != 1 {
		return "", false
	}
	var v [4]uint64
	for i, part := range []string{dom, bus, slot, fn} {
		for j := 0; j < len(part); j++ {
			c := part[j]
			if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F') {
				return "", false
			}
		}
		n, err := strconv.ParseUint(part, 16, 32)
		if err != nil {
			return "", false
		}
		v[i] = n
	}
	if v[2] > 0x1f || v[3] > 7 {
		return "", false
	}
	return fmt.Sprintf("%04x:%02x:%02x.%x", v[0], v[1], v[2], v[3]), true
}
