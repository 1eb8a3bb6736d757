package vm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/image/workspace"
	"github.com/carrel-os/carrel/supervisor/driver"
	"github.com/carrel-os/carrel/supervisor/registry"
)

// WorkspaceDiskName is the VM's workspace disk in its directory.
const WorkspaceDiskName = "workspace.qcow2"

// workspaceSize is the size of rec's workspace: as created with, else half
// its memory, as the guest sizes a tmpfs workspace.
func workspaceSize(rec registry.Record) uint64 {
	if rec.WorkspaceBytes > 0 {
		return rec.WorkspaceBytes
	}
	return max(rec.MemoryBytes/2&^(1<<20-1), workspace.TemplateSize)
}

// attachWorkspace gives spec the VM's workspace disk, a copy-on-write
// qcow2 file over the image's template, made at the VM's first boot and
// kept, with the VM's files, from one run to the next until the VM is
// removed with its directory; and tells the guest to use it.
func (m *Manager) attachWorkspace(ctx context.Context, rec registry.Record, template string, spec *driver.Spec) error {
	disk := filepath.Join(spec.Dir, WorkspaceDiskName)
	switch _, err := os.Lstat(disk); {
	case errors.Is(err, os.ErrNotExist):
		size := workspaceSize(rec)
		qemuImg := m.cfg.QEMUImg
		if qemuImg == "" {
			qemuImg = "qemu-img"
		}
		if err := workspace.Create(ctx, qemuImg, disk, template, size); err != nil {
			return err
		}
		m.log.Info("workspace disk created", "vm", rec.Name, "bytes", size, "template", template)
	case err != nil:
		return fmt.Errorf("workspace disk: %w", err)
	}
	spec.Workspace, spec.WorkspaceTemplate = disk, template
	spec.Cmdline += " " + protocol.WorkspaceDiskArg
	return nil
}
