package vm

import (
	"fmt"

	"github.com/carrel-os/carrel/supervisor/registry"
)

// limitArgs are the kernel command line arguments that carry rec's limits
// to the guest, which applies them (guest-agent/initsys.Limits).
func limitArgs(rec registry.Record) string {
	s := ""
	if rec.WorkspaceBytes > 0 {
		s += fmt.Sprintf(" carrel.workspace_bytes=%d", rec.WorkspaceBytes)
	}
	if rec.MaxProcesses > 0 {
		s += fmt.Sprintf(" carrel.max_processes=%d", rec.MaxProcesses)
	}
	return s
}
