package initsys

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Limits are the resource limits carreld gives a VM on its kernel command
// line, for the guest to apply itself:
//
//	carrel.workspace_bytes=N   the size of a tmpfs /workspace (on the
//	                           workspace disk, the disk's size is the cap)
//	carrel.max_processes=N     processes (and threads) all commands may have
//
// Zero means unlimited (the defaults: half the memory, and the kernel's).
type Limits struct {
	WorkspaceBytes uint64
	MaxProcesses   uint64
}

// Bounds of the limits; a value outside them is refused (and ignored).
const (
	MinWorkspaceBytes = 16 << 20
	MaxWorkspaceBytes = 1 << 40
	MinProcesses      = 16
	MaxProcesses      = 1 << 22
)

// ReadLimits reads the limits from /proc/cmdline.
func ReadLimits() (Limits, error) {
	b, err := os.ReadFile("/proc/cmdline")
	if err != nil {
		return Limits{}, err
	}
	return ParseLimits(string(b))
}

// ParseLimits reads the limits from a kernel command line. A malformed or
// out-of-range value is an error; the other limits are still returned.
func ParseLimits(cmdline string) (Limits, error) {
	var l Limits
	var errs []string
	for _, f := range strings.Fields(cmdline) {
		k, v, ok := strings.Cut(f, "=")
		if !ok {
			continue
		}
		var dst *uint64
		var lo, hi uint64
		switch k {
		case "carrel.workspace_bytes":
			dst, lo, hi = &l.WorkspaceBytes, MinWorkspaceBytes, MaxWorkspaceBytes
		case "carrel.max_processes":
			dst, lo, hi = &l.MaxProcesses, MinProcesses, MaxProcesses
		default:
			continue
		}
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil || n < lo || n > hi {
			errs = append(errs, fmt.Sprintf("%s=%q: want %d to %d", k, v, lo, hi))
			continue
		}
		*dst = n
	}
	if len(errs) > 0 {
		return l, fmt.Errorf("kernel command line: %s", strings.Join(errs, "; "))
	}
	return l, nil
}
