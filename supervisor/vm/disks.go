package vm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/image/store"
	"github.com/carrel-os/carrel/image/workspace"
	"github.com/carrel-os/carrel/supervisor/driver"
	"github.com/carrel-os/carrel/supervisor/registry"
)

// Disk files in a VM's directory.
const (
	// WorkspaceDiskName is the VM's /workspace.
	WorkspaceDiskName = "workspace.qcow2"
	// StateDiskName holds the VM's writable layer over its image's
	// verified root: everything it changed outside /workspace.
	StateDiskName = "state.qcow2"
)

// writableSerials are the serials of a VM's own disks, which snapshots
// freeze and restores replace.
var writableSerials = []string{protocol.StateSerial, protocol.WorkspaceSerial}

// diskName is the file in rec's directory of its writable disk serial.
func diskName(rec registry.Record, serial string) string {
	if n := rec.Disks[serial]; n != "" {
		return n
	}
	if serial == protocol.StateSerial {
		return StateDiskName
	}
	return WorkspaceDiskName
}

// newDiskName is a file name no disk of the VM has had: "state-" or
// "workspace-", 8 random hex digits, ".qcow2".
func newDiskName(serial string) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return strings.TrimPrefix(serial, "carrel-") + "-" + hex.EncodeToString(b[:]) + ".qcow2"
}

// DefaultStateBytes is the size of a VM's writable layer when its create
// named none. The disk is sparse: it takes only what the VM writes.
const DefaultStateBytes = 8 << 30

// workspaceSize is the size of rec's workspace: as created with, else half
// its memory, as the guest sizes a tmpfs workspace.
func workspaceSize(rec registry.Record) uint64 {
	if rec.WorkspaceBytes > 0 {
		return rec.WorkspaceBytes
	}
	return max(rec.MemoryBytes/2&^(1<<20-1), workspace.TemplateSize)
}

// stateSize is the size of rec's writable layer.
func stateSize(rec registry.Record) uint64 {
	if rec.DiskBytes > 0 {
		return rec.DiskBytes
	}
	return DefaultStateBytes
}

// Footprint is what a VM holds of the host, as an API key's limits count
// it: its memory, and the sizes of the disks it may fill, as created (they
// are sparse, so this is what it may take, not what it takes): its
// writable layer (none when it is ephemeral) and its workspace.
type Footprint struct {
	MemoryBytes, DiskBytes uint64
}

// FootprintOf is the footprint of the VM rec.
func FootprintOf(rec registry.Record) Footprint {
	disk := workspaceSize(rec)
	if !rec.Ephemeral {
		disk += stateSize(rec)
	}
	return Footprint{MemoryBytes: rec.MemoryBytes, DiskBytes: disk}
}

// Footprint is the footprint of the VM Create would make of p.
func (p CreateParams) Footprint() Footprint {
	mem := p.MemoryBytes
	if mem == 0 {
		mem = DefaultMemory
	}
	return FootprintOf(registry.Record{MemoryBytes: mem, WorkspaceBytes: p.WorkspaceBytes, Ephemeral: p.Ephemeral, DiskBytes: p.DiskBytes})
}

// attachDisks gives spec the VM's disks and tells the guest of them: the
// image's verified root and hash device, read-only and shared by every VM
// of the image; the VM's writable layer over that root (a disk of its own,
// or memory when it is ephemeral); and its workspace disk when the image
// has a workspace template (else /workspace is a tmpfs). The VM's own
// disks are copy-on-write qcow2 files over a template, made at its first
// boot and kept from one run to the next until it is reset or removed.
func (m *Manager) attachDisks(ctx context.Context, rec registry.Record, img *store.Resolved, spec *driver.Spec) error {
	if img.SystemPath != "" {
		spec.Disks = append(spec.Disks,
			driver.Disk{Path: img.SystemPath, Format: driver.FormatRaw, ReadOnly: true, Serial: protocol.SystemSerial},
			driver.Disk{Path: img.SystemVerityPath, Format: driver.FormatRaw, ReadOnly: true, Serial: protocol.SystemVeritySerial})
		if rec.Ephemeral {
			spec.Cmdline += " " + protocol.StateArg + "=" + protocol.StateMemory
		} else {
			tpl, err := m.template(ctx, img)
			if err != nil {
				return err
			}
			d, err := m.vmDisk(ctx, rec, spec.Dir, diskName(rec, protocol.StateSerial), tpl, stateSize(rec))
			if err != nil {
				return fmt.Errorf("state disk: %w", err)
			}
			d.Serial = protocol.StateSerial
			spec.Disks = append(spec.Disks, d)
			spec.Cmdline += " " + protocol.StateArg + "=" + protocol.StateDisk
		}
	}
	if img.WorkspacePath != "" {
		d, err := m.vmDisk(ctx, rec, spec.Dir, diskName(rec, protocol.WorkspaceSerial), img.WorkspacePath, workspaceSize(rec))
		if err != nil {
			return fmt.Errorf("workspace disk: %w", err)
		}
		d.Serial = protocol.WorkspaceSerial
		spec.Disks = append(spec.Disks, d)
		spec.Cmdline += " " + protocol.WorkspaceDiskArg
	}
	return nil
}

// vmDisk returns the VM's disk file name in dir, making it, of size bytes
// over template, if it does not exist yet.
func (m *Manager) vmDisk(ctx context.Context, rec registry.Record, dir, name, template string, size uint64) (driver.Disk, error) {
	disk := filepath.Join(dir, name)
	switch _, err := os.Lstat(disk); {
	case errors.Is(err, os.ErrNotExist):
		if err := workspace.Create(ctx, m.qemuImg(), disk, template, size); err != nil {
			return driver.Disk{}, err
		}
		m.log.Info("disk created", "vm", rec.Name, "disk", name, "bytes", size, "template", template)
	case err != nil:
		return driver.Disk{}, err
	}
	// A disk over a snapshot's frozen layers has them between it and the
	// template.
	files, err := chain(disk)
	if err != nil {
		return driver.Disk{}, err
	}
	if files[len(files)-1] != template {
		return driver.Disk{}, fmt.Errorf("disk %s stands on %s, not on its template %s", disk, files[len(files)-1], template)
	}
	d := driver.Disk{Path: disk, Format: driver.FormatQCOW2, Backing: template}
	if len(files) > 2 {
		d.Layers = files[1 : len(files)-1]
	}
	if err := m.checkLayers(rec, d.Layers); err != nil {
		return driver.Disk{}, fmt.Errorf("disk %s: %w", disk, err)
	}
	return d, nil
}

// checkLayers refuses frozen layers that lie anywhere but where the
// snapshots of this VM, and of the VMs it was forked from, put theirs.
// The chain is read from the disks' qcow2 headers, which the VM's own
// QEMU writes: a QEMU a guest took over could name another VM's disk
// there, and its next start would show it that disk (and hand it over as
// a read-only layer). Nor may a layer be a disk some VM writes now.
func (m *Manager) checkLayers(rec registry.Record, layers []string) error {
	if len(layers) == 0 {
		return nil
	}
	allowed := map[string]bool{m.cfg.Registry.Dir(rec.Name): true}
	for o, n := rec.Origin, 0; o != nil && n < 64; n++ {
		allowed[m.cfg.Registry.Dir(o.VM)] = true
		parent, err := m.cfg.Registry.Get(o.VM)
		if err != nil {
			break // gone; its layers stay where they were
		}
		o = parent.Origin
	}
	live := map[string]string{}
	for _, st := range m.List() {
		dir := m.cfg.Registry.Dir(st.Name)
		for _, serial := range writableSerials {
			for _, n := range []string{diskName(st.Record, serial), st.PendingDisks[serial]} {
				if n != "" {
					live[filepath.Join(dir, n)] = st.Name
				}
			}
		}
	}
	for _, l := range layers {
		if !allowed[filepath.Dir(l)] {
			return fmt.Errorf("its layer %s lies outside the directories of vm %q and the vms it was forked from: its qcow2 header was changed; restore a snapshot or reset the vm", l, rec.Name)
		}
		if owner, ok := live[l]; ok {
			return fmt.Errorf("its layer %s is vm %q's writable disk: its qcow2 header was changed; restore a snapshot or reset the vm", l, owner)
		}
		if fi, err := os.Lstat(l); err != nil || !fi.Mode().IsRegular() {
			return fmt.Errorf("its layer %s is not a regular file", l)
		}
	}
	return nil
}

func (m *Manager) qemuImg() string {
	if m.cfg.QEMUImg == "" {
		return "qemu-img"
	}
	return m.cfg.QEMUImg
}

// template is the raw ext4 template of a VM's writable-layer disk: the
// image's workspace template when it has one, else carreld's own
// (Config.DiskTemplate), made when first needed.
func (m *Manager) template(ctx context.Context, img *store.Resolved) (string, error) {
	if img.WorkspacePath != "" {
		return img.WorkspacePath, nil
	}
	p := m.cfg.DiskTemplate
	if p == "" {
		return "", errors.New("the image has no disk template and carreld has none configured")
	}
	m.templateMu.Lock()
	defer m.templateMu.Unlock()
	if _, err := os.Stat(p); err == nil {
		return p, nil
	}
	if err := workspace.Template(ctx, p); err != nil {
		return "", err
	}
	return p, os.Chmod(p, 0o444)
}
