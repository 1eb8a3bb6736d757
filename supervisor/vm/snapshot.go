package vm

import (
	"connectrpc.com/connect"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/image/workspace"
	"github.com/carrel-os/carrel/supervisor/agentlink"
	"github.com/carrel-os/carrel/supervisor/atomicfile"
	"github.com/carrel-os/carrel/supervisor/driver"
	"github.com/carrel-os/carrel/supervisor/registry"
)

// Snapshots live in the directory of the VM they were taken of, one
// directory each, named by the snapshot: the saved state (memory and
// devices) and snapshot.json. The disk layers stay where the VM had them,
// frozen, and the VM goes on over new overlays. A directory being written
// is named ".tmp-NAME": nothing lists it, and Reconcile removes it.
const (
	snapshotsDir     = "snapshots"
	snapshotManifest = "snapshot.json"
	snapshotState    = "state"
	tmpPrefix        = ".tmp-"
	maxManifestBytes = 1 << 20
)

// ErrSnapshotDamaged means a snapshot's files are missing or not what it
// recorded: it cannot be restored.
var ErrSnapshotDamaged = errors.New("snapshot is damaged")

// Snapshot is a VM at one instant: its memory and device state, and every
// writable disk, saved with its vCPUs stopped. It keeps what a restore or
// a fork needs to start the same machine.
type Snapshot struct {
	Name      string    `json:"name"`
	VM        string    `json:"vm"`
	VMID      string    `json:"vm_id"`
	CreatedAt time.Time `json:"created_at"`
	// Session is the run it was taken in: the parent of the sessions that
	// start from it.
	Session string `json:"session"`
	// The machine: a VM started from the snapshot has exactly this.
	ImageDigest    string `json:"image_digest"`
	RootHash       string `json:"root_hash,omitempty"`
	MemoryBytes    uint64 `json:"memory_bytes"`
	CPUs           uint32 `json:"cpus"`
	Driver         string `json:"driver"`
	Policy         string `json:"policy"`
	WorkspaceBytes uint64 `json:"workspace_bytes,omitempty"`
	MaxProcesses   uint64 `json:"max_processes,omitempty"`
	Ephemeral      bool   `json:"ephemeral,omitempty"`
	DiskBytes      uint64 `json:"disk_bytes,omitempty"`
	// DataPort is whether the VM had the data port (driver.Spec.NoDataPort):
	// QEMU loads a state only into a VM with the ports it was saved with.
	// Snapshots from before the data port lack it, and restore without.
	DataPort bool `json:"data_port,omitempty"`
	// State is QEMU's saved state, in the snapshot's directory.
	State SnapshotFile `json:"state"`
	// Disks are the frozen layers, by serial.
	Disks []SnapshotDisk `json:"disks"`
	// Guest is set for a checkpoint the guest asked for; Note is the
	// words it came with.
	Guest bool   `json:"guest,omitempty"`
	Note  string `json:"note,omitempty"`
}

// SnapshotFile is a file of a snapshot and what it held when taken.
type SnapshotFile struct {
	Path   string `json:"path"`
	SHA256 string `json:"sha256"`
	Bytes  uint64 `json:"bytes"`
}

// SnapshotDisk is a frozen disk layer: the file the VM wrote until the
// snapshot, a qcow2 over the layers and template below it.
type SnapshotDisk struct {
	Serial string `json:"serial"`
	SnapshotFile
	VirtualBytes uint64 `json:"virtual_bytes"`
}

// Bytes is what the snapshot's own files take: its state and its layers.
func (s Snapshot) Bytes() uint64 {
	n := s.State.Bytes
	for _, d := range s.Disks {
		n += d.Bytes
	}
	return n
}

// SnapshotParams are the arguments of Snapshot.
type SnapshotParams struct {
	Name  string
	Note  string
	Guest bool
}

// maxNote bounds a snapshot's note.
const maxNote = 1024

func (m *Manager) snapshotsOf(vm string) string {
	return filepath.Join(m.cfg.Registry.Dir(vm), snapshotsDir)
}

// Snapshot saves a running VM: its vCPUs stop, its writable disks are
// frozen and it moves to new overlays over them, its memory and device
// state are saved, and it runs on (a VM its operator paused stays
// paused). A failure leaves no snapshot and a VM that runs on; its disks
// are whole either way.
func (m *Manager) Snapshot(ctx context.Context, vmName string, p SnapshotParams) (Snapshot, error) {
	var snap Snapshot
	err := m.locked(ctx, vmName, func(mc *machine) error {
		var err error
		snap, err = m.snapshotLocked(ctx, mc, p)
		return err
	})
	return snap, err
}

func (m *Manager) snapshotLocked(ctx context.Context, mc *machine, p SnapshotParams) (_ Snapshot, err error) {
	rec := mc.snapshot()
	if rec.State != registry.StateRunning || rec.Instance == nil {
		return Snapshot{}, fmt.Errorf("%w: %q is %s", ErrNotRunning, rec.Name, rec.State)
	}
	if len(rec.GPUs) > 0 {
		return Snapshot{}, fmt.Errorf("%w: %q has GPUs passed through, whose state QEMU cannot save", ErrInvalid, rec.Name)
	}
	if err := validSnapshotName(p.Name); err != nil {
		return Snapshot{}, err
	}
	sn, err := driver.SnapshotterFor(m.cfg.Driver, rec.Driver)
	if err != nil {
		return Snapshot{}, err
	}
	if len(rec.PendingDisks) > 0 {
		return Snapshot{}, fmt.Errorf("%w: an earlier snapshot of %q left its disks unsettled (its driver could not say whether they moved); restart carreld to settle them", ErrBusy, rec.Name)
	}
	if len(p.Note) > maxNote {
		return Snapshot{}, fmt.Errorf("%w: a note of %d bytes, over %d", ErrInvalid, len(p.Note), maxNote)
	}
	dir := m.snapshotsOf(rec.Name)
	final := filepath.Join(dir, p.Name)
	if _, err := os.Lstat(final); err == nil {
		return Snapshot{}, fmt.Errorf("%w: %q already has a snapshot %q", ErrExists, rec.Name, p.Name)
	}
	tmp := filepath.Join(dir, tmpPrefix+p.Name)
	_ = os.RemoveAll(tmp)
	if err := os.MkdirAll(tmp, 0o700); err != nil {
		return Snapshot{}, fmt.Errorf("snapshot %q: %w", rec.Name, err)
	}
	defer func() {
		if err != nil {
			_ = os.RemoveAll(tmp)
		}
	}()
	start := time.Now()
	vmDir := m.cfg.Registry.Dir(rec.Name)
	// The VM's writable disks, and the overlays it moves to.
	cur, next := map[string]string{}, map[string]string{}
	for _, serial := range writableSerials {
		n := diskName(rec, serial)
		if _, err := os.Stat(filepath.Join(vmDir, n)); err == nil {
			cur[serial], next[serial] = n, newDiskName(serial)
		}
	}
	// Named before QEMU makes them, so that a carreld that dies meanwhile
	// knows which files to look at (reconcilePending).
	if err := m.persist(mc, func(r *registry.Record) { r.PendingDisks = next }); err != nil {
		return Snapshot{}, err
	}
	// The vCPUs stop for the disks and the state to be of one instant.
	inst := *rec.Instance
	stopped, saving := false, false
	if !rec.Paused {
		if err := m.setVCPUs(ctx, mc, false); err != nil {
			return Snapshot{}, errors.Join(fmt.Errorf("snapshot %q: %w", rec.Name, err), m.persist(mc, func(r *registry.Record) { r.PendingDisks = nil }))
		}
		stopped = true
	}
	resume := func() error {
		if !stopped {
			return nil
		}
		stopped = false
		// Unless carreld's hold began meanwhile: ResumeAll resumes it then.
		if err := m.setVCPUs(context.WithoutCancel(ctx), mc, true); err != nil {
			return fmt.Errorf("the vm could not be resumed after its snapshot: %w", err)
		}
		return nil
	}
	defer func() {
		if rerr := resume(); rerr != nil {
			err = errors.Join(err, rerr)
		}
		if saving && rec.Paused {
			if uerr := m.unstick(ctx, mc); uerr != nil {
				err = errors.Join(err, uerr)
			}
		}
	}()

	overlays := map[string]string{}
	for serial, n := range cur {
		overlays[filepath.Join(vmDir, n)] = filepath.Join(vmDir, next[serial])
	}
	err = sn.FreezeDisks(ctx, inst, overlays)
	if errors.Is(err, driver.ErrDisksUnknown) {
		// Left named in the record, for the next start to settle.
		return Snapshot{}, fmt.Errorf("snapshot %q: freeze disks: %w; carreld settles them when it next starts", rec.Name, err)
	}
	if err != nil {
		for _, n := range next {
			_ = os.Remove(filepath.Join(vmDir, n))
		}
		return Snapshot{}, errors.Join(fmt.Errorf("snapshot %q: freeze disks: %w", rec.Name, err), m.persist(mc, func(r *registry.Record) { r.PendingDisks = nil }))
	}
	// The VM writes the new overlays now, whatever happens next.
	if err := m.persist(mc, func(r *registry.Record) {
		if r.Disks == nil {
			r.Disks = map[string]string{}
		}
		for serial, n := range next {
			r.Disks[serial] = n
		}
		r.PendingDisks = nil
	}); err != nil {
		return Snapshot{}, err
	}
	statePath := filepath.Join(tmp, snapshotState)
	saving = true
	n, err := saveState(ctx, sn, inst, statePath, maxStateBytes(rec.MemoryBytes))
	if err != nil {
		return Snapshot{}, fmt.Errorf("snapshot %q: save state: %w", rec.Name, err)
	}
	if err := resume(); err != nil {
		return Snapshot{}, err
	}
	pause := time.Since(start)
	// Hashed with the vCPUs running again.
	state, err := sealState(statePath, n)
	if err != nil {
		return Snapshot{}, fmt.Errorf("snapshot %q: save state: %w", rec.Name, err)
	}
	snap := Snapshot{
		Name: p.Name, VM: rec.Name, VMID: rec.ID, CreatedAt: start.UTC().Truncate(time.Millisecond), Session: rec.Session,
		ImageDigest: rec.ImageDigest, RootHash: rec.RootHash, MemoryBytes: rec.MemoryBytes, CPUs: rec.CPUs, Driver: rec.Driver,
		Policy: rec.PolicyName(), WorkspaceBytes: rec.WorkspaceBytes, MaxProcesses: rec.MaxProcesses,
		Ephemeral: rec.Ephemeral, DiskBytes: rec.DiskBytes,
		Guest: p.Guest, Note: p.Note, DataPort: inst.DataSocket != "",
	}
	snap.State = state
	snap.State.Path = filepath.Join(final, snapshotState) // where it is once renamed
	for _, serial := range writableSerials {
		n, ok := cur[serial]
		if !ok {
			continue
		}
		path := filepath.Join(vmDir, n)
		// Frozen: nothing writes it again. Read-only keeps it so.
		if err := os.Chmod(path, 0o444); err != nil {
			return Snapshot{}, fmt.Errorf("snapshot %q: %w", rec.Name, err)
		}
		f, err := hashFile(path)
		if err != nil {
			return Snapshot{}, fmt.Errorf("snapshot %q: %w", rec.Name, err)
		}
		info, err := readQCOW2(path)
		if err != nil {
			return Snapshot{}, fmt.Errorf("snapshot %q: %w", rec.Name, err)
		}
		snap.Disks = append(snap.Disks, SnapshotDisk{Serial: serial, SnapshotFile: f, VirtualBytes: info.VirtualBytes})
	}
	b, err := json.MarshalIndent(snap, "", "  ")
	if err != nil {
		return Snapshot{}, err
	}
	if err := atomicfile.WriteFile(filepath.Join(tmp, snapshotManifest), append(b, '\n'), 0o400); err != nil {
		return Snapshot{}, fmt.Errorf("snapshot %q: %w", rec.Name, err)
	}
	if err := os.Rename(tmp, final); err != nil {
		return Snapshot{}, fmt.Errorf("snapshot %q: %w", rec.Name, err)
	}
	if err := atomicfile.SyncDir(dir); err != nil {
		return Snapshot{}, fmt.Errorf("snapshot %q: %w", rec.Name, err)
	}
	m.log.Info("vm snapshot taken", "vm", rec.Name, "snapshot", p.Name, "state_bytes", state.Bytes, "bytes", snap.Bytes(),
		"vcpus_stopped", pause.Round(time.Millisecond), "guest", p.Guest)
	_ = m.eventSnap(ctx, mc, EventSnapshot, &snap, fmt.Sprintf("snapshot %q taken: %d bytes, vcpus stopped %s", p.Name, snap.Bytes(), pause.Round(time.Millisecond)))
	return snap, nil
}

// unstick takes a VM its operator paused out of where a save left its
// QEMU ("postmigrate"), from which QEMU refuses the next save, with a
// moment's run. A VM that then cannot be paused again is recorded as
// running, as it is.
func (m *Manager) unstick(ctx context.Context, mc *machine) error {
	ctx = context.WithoutCancel(ctx)
	if err := m.setVCPUs(ctx, mc, true); err != nil {
		return fmt.Errorf("the paused vm could not leave its saved state, and may refuse the next snapshot until it is resumed: %w", err)
	}
	if err := m.setVCPUs(ctx, mc, false); err != nil {
		perr := m.persist(mc, func(r *registry.Record) { r.Paused, r.PausedAt = false, time.Time{} })
		m.holdLink(ctx, mc) // it runs: calls go through again
		return fmt.Errorf("the vm runs again: it could not be paused after its snapshot: %w", joinErr(err, perr))
	}
	return nil
}

// Bounds on saving a state. QEMU's stream is the guest's RAM (zero pages
// as flags only, the rest with an 8-byte header per page) and its devices'
// state, which is small; a stream that outgrows that, or a save that
// outlasts saveTimeout, is cut, so that a broken QEMU cannot fill the disk
// or hold the VM's vCPUs stopped.
const saveTimeout = 10 * time.Minute

func maxStateBytes(memory uint64) int64 {
	return int64(memory + memory/64 + 64<<20)
}

// saveState saves inst's state into a new file at path, at most max
// bytes, within saveTimeout.
func saveState(ctx context.Context, sn driver.Snapshotter, inst driver.Instance, path string, max int64) (int64, error) {
	ctx, cancel := context.WithTimeout(ctx, saveTimeout)
	defer cancel()
	return sn.SaveState(ctx, inst, path, max)
}

// sealState hashes and syncs the state a driver saved at path, which must
// be the size it said it wrote.
func sealState(path string, n int64) (SnapshotFile, error) {
	f, err := os.Open(path)
	if err != nil {
		return SnapshotFile{}, err
	}
	defer f.Close()
	sum, size, err := hashReader(f)
	if err == nil && size != uint64(n) {
		err = fmt.Errorf("the saved state %s is %d bytes, but %d were written", path, size, n)
	}
	if err == nil {
		err = f.Sync()
	}
	if err != nil {
		return SnapshotFile{}, err
	}
	return SnapshotFile{Path: path, SHA256: sum, Bytes: size}, nil
}

// hashFile returns path's digest and size.
func hashFile(path string) (SnapshotFile, error) {
	f, err := os.Open(path)
	if err != nil {
		return SnapshotFile{}, err
	}
	defer f.Close()
	sum, n, err := hashReader(f)
	return SnapshotFile{Path: path, SHA256: sum, Bytes: n}, err
}

// hashReader returns the sha256 (hex) and length of what r holds.
func hashReader(r io.Reader) (string, uint64, error) {
	h := sha256.New()
	n, err := io.Copy(h, r)
	return hex.EncodeToString(h.Sum(nil)), uint64(n), err
}

func validSnapshotName(name string) error {
	if protocol.ValidVMName(name) != nil {
		return fmt.Errorf("%w: snapshot name %q: use 1-63 lower-case letters, digits and '-', starting with a letter", ErrInvalid, name)
	}
	return nil
}

// Snapshots lists a VM's snapshots, oldest first.
func (m *Manager) Snapshots(vmName string) ([]Snapshot, error) {
	if _, err := m.get(vmName); err != nil {
		return nil, err
	}
	ents, err := os.ReadDir(m.snapshotsOf(vmName))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []Snapshot
	for _, e := range ents {
		if !e.IsDir() || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		s, err := m.loadSnapshot(vmName, e.Name())
		if err != nil {
			m.log.Warn("unreadable snapshot", "vm", vmName, "snapshot", e.Name(), "err", err)
			continue
		}
		out = append(out, s)
	}
	slices.SortFunc(out, func(a, b Snapshot) int { return a.CreatedAt.Compare(b.CreatedAt) })
	return out, nil
}

// loadSnapshot reads a snapshot's manifest.
func (m *Manager) loadSnapshot(vmName, name string) (Snapshot, error) {
	if err := validSnapshotName(name); err != nil {
		return Snapshot{}, err
	}
	path := filepath.Join(m.snapshotsOf(vmName), name, snapshotManifest)
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return Snapshot{}, fmt.Errorf("%w: %q has no snapshot %q", ErrNotFound, vmName, name)
	}
	if err != nil {
		return Snapshot{}, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxManifestBytes+1))
	if err != nil {
		return Snapshot{}, err
	}
	if len(b) > maxManifestBytes {
		return Snapshot{}, fmt.Errorf("%w: %s is over %d bytes", ErrSnapshotDamaged, path, maxManifestBytes)
	}
	var s Snapshot
	if err := json.Unmarshal(b, &s); err != nil {
		return Snapshot{}, fmt.Errorf("%w: %s: %w", ErrSnapshotDamaged, path, err)
	}
	if s.Name != name || s.VM != vmName {
		return Snapshot{}, fmt.Errorf("%w: %s names snapshot %q of %q", ErrSnapshotDamaged, path, s.Name, s.VM)
	}
	return s, nil
}

// verify checks that everything s needs is there and unchanged: its
// image, each disk layer and its state, by digest. It returns the state,
// open, for the driver to start from: the file it hashed, so what QEMU
// reads is what was checked.
func (m *Manager) verify(s Snapshot) (*os.File, error) {
	if _, err := m.cfg.Images.Resolve(s.ImageDigest); err != nil {
		return nil, fmt.Errorf("%w: its image %s: %w", ErrSnapshotDamaged, s.ImageDigest, err)
	}
	for _, d := range s.Disks {
		got, err := hashFile(d.Path)
		if err != nil {
			return nil, fmt.Errorf("%w: disk layer %s: %w", ErrSnapshotDamaged, d.Path, err)
		}
		if got.SHA256 != d.SHA256 || got.Bytes != d.Bytes {
			return nil, fmt.Errorf("%w: disk layer %s changed since the snapshot (sha256 %s, want %s)", ErrSnapshotDamaged, d.Path, got.SHA256, d.SHA256)
		}
	}
	f, err := os.Open(s.State.Path)
	if err != nil {
		return nil, fmt.Errorf("%w: state: %w", ErrSnapshotDamaged, err)
	}
	sum, n, err := hashReader(f)
	if err == nil && (sum != s.State.SHA256 || n != s.State.Bytes) {
		err = fmt.Errorf("its state %s changed since the snapshot (%d bytes, sha256 %s; want %d, %s)", s.State.Path, n, sum, s.State.Bytes, s.State.SHA256)
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("%w: %w", ErrSnapshotDamaged, err)
	}
	return f, nil
}

// restoredAttempt is how long one readiness probe of a guest started from
// a snapshot waits: its agent answers within a few hundred milliseconds
// once a handshake gets through.
const restoredAttempt = 250 * time.Millisecond

// restoredSettle is how long carreld leaves a restored guest to run before
// it connects to its agent. The agent wakes in the HTTP/2 session it had
// with the previous QEMU and drops it only when it reads EOF, which its
// port reports while no host is connected: QEMU tells the guest once its
// vCPUs run that the host end it had is gone. A host that connects before
// the agent has read that keeps the old session alive, which then takes
// the host's handshake for its own bytes (GOAWAY), and the next handshakes
// are lost while it closes: 1.5-2 s here, against about 0.3 s when the
// guest gets the time to settle. The guest needs 20-60 ms for it on an
// idle TCG host; a slower one falls back to those retries. QEMU's
// VSERPORT_CHANGE events would say exactly when the agent has opened its
// port again, but carreld does not listen to QEMU's events.
const restoredSettle = 150 * time.Millisecond

// startPoint is a snapshot a boot starts from instead of booting.
type startPoint struct {
	snap  Snapshot
	state *os.File // verified
	fork  bool
}

// layerOver makes the VM's new overlays in dir over s's frozen layers and
// returns their names by serial.
func (m *Manager) layerOver(ctx context.Context, dir string, s Snapshot) (map[string]string, error) {
	names := map[string]string{}
	for _, d := range s.Disks {
		n := newDiskName(d.Serial)
		if err := workspace.Overlay(ctx, m.qemuImg(), filepath.Join(dir, n), d.Path, d.VirtualBytes); err != nil {
			for _, made := range names {
				_ = os.Remove(filepath.Join(dir, made))
			}
			return nil, err
		}
		names[d.Serial] = n
	}
	return names, nil
}

// Restore puts a VM back at a snapshot's instant, processes and all: a
// running VM's QEMU ends and a new one starts from the snapshot, in a new
// session whose origin is the snapshot; a stopped VM starts so. What the
// VM did since is gone (other snapshots keep theirs). A snapshot that is
// damaged or whose image is gone is refused before anything changes.
func (m *Manager) Restore(ctx context.Context, vmName, snapName string) (registry.Record, error) {
	var rec registry.Record
	err := m.locked(ctx, vmName, func(mc *machine) error {
		s, err := m.loadSnapshot(vmName, snapName)
		if err != nil {
			return err
		}
		if _, err := driver.SnapshotterFor(m.cfg.Driver, s.Driver); err != nil {
			return err
		}
		state, err := m.verify(s)
		if err != nil {
			return fmt.Errorf("restore %q to %q: %w", vmName, snapName, err)
		}
		defer state.Close()
		r := mc.snapshot()
		if r.MemoryBytes != s.MemoryBytes || r.CPUs != s.CPUs || r.ImageDigest != s.ImageDigest {
			return fmt.Errorf("%w: snapshot %q is of another machine (image, memory or cpus differ)", ErrSnapshotDamaged, snapName)
		}
		dir := m.cfg.Registry.Dir(vmName)
		names, err := m.layerOver(ctx, dir, s)
		if err != nil {
			return fmt.Errorf("restore %q: %w", vmName, err)
		}
		if err := m.stopLocked(ctx, mc, true); err != nil {
			for _, n := range names {
				_ = os.Remove(filepath.Join(dir, n))
			}
			return err
		}
		old := mc.snapshot()
		if err := m.persist(mc, func(r *registry.Record) {
			r.Disks, r.State = names, registry.StateStarting
			r.Origin = &registry.Origin{VM: s.VM, Snapshot: s.Name, Session: s.Session}
		}); err != nil {
			return err
		}
		// The files the VM wrote until now are its own: no snapshot has them.
		for _, serial := range writableSerials {
			if n := diskName(old, serial); n != names[serial] {
				_ = os.Remove(filepath.Join(dir, n))
			}
		}
		m.collect(vmName)
		if err := m.boot(ctx, mc, &startPoint{snap: s, state: state}); err != nil {
			m.markStopped(mc, EventFailed, err.Error())
			return err
		}
		rec = mc.snapshot()
		return nil
	})
	return rec, err
}

// Fork makes a new VM, dst, from a snapshot of src (a new one taken now
// when snapName is ""): the same machine at that instant, with its own
// name, ID, session, disks over the snapshot's frozen layers, random seed,
// clock and machine id.
func (m *Manager) Fork(ctx context.Context, src, dst, snapName string) (registry.Record, error) {
	if err := protocol.ValidVMName(dst); err != nil {
		return registry.Record{}, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if _, err := m.get(dst); err == nil {
		return registry.Record{}, fmt.Errorf("%w: %q", ErrExists, dst)
	}
	if from, err := m.get(src); err == nil {
		if _, err := driver.SnapshotterFor(m.cfg.Driver, from.snapshot().Driver); err != nil {
			return registry.Record{}, err
		}
	}
	if snapName == "" {
		snapName = "fork-" + dst
		if _, err := m.Snapshot(ctx, src, SnapshotParams{Name: snapName, Note: "taken to fork " + dst}); err != nil {
			return registry.Record{}, err
		}
	}
	s, err := m.loadSnapshot(src, snapName)
	if err != nil {
		return registry.Record{}, err
	}
	state, err := m.verify(s)
	if err != nil {
		return registry.Record{}, fmt.Errorf("fork %q from %q: %w", dst, snapName, err)
	}
	defer state.Close()
	end, err := m.begin()
	if err != nil {
		return registry.Record{}, err
	}
	defer end()
	mc := newMachine(registry.Record{
		Name: dst, ID: newID(), ImageDigest: s.ImageDigest, RootHash: s.RootHash,
		MemoryBytes: s.MemoryBytes, CPUs: s.CPUs, Driver: s.Driver, State: registry.StateCreating,
		CreatedAt: time.Now().UTC().Truncate(time.Millisecond), Policy: s.Policy, Session: newSession(),
		WorkspaceBytes: s.WorkspaceBytes, MaxProcesses: s.MaxProcesses, Ephemeral: s.Ephemeral, DiskBytes: s.DiskBytes,
		Origin: &registry.Origin{VM: s.VM, Snapshot: s.Name, Session: s.Session, Fork: true},
	})
	mc.op <- struct{}{}
	defer mc.unlock()
	m.mu.Lock()
	if _, ok := m.vms[dst]; ok {
		m.mu.Unlock()
		return registry.Record{}, fmt.Errorf("%w: %q", ErrExists, dst)
	}
	m.vms[dst] = mc
	m.mu.Unlock()
	err = m.persist(mc, nil)
	if err == nil {
		err = m.event(ctx, mc, EventCreated, fmt.Sprintf("forked from snapshot %q of %q (session %s)", s.Name, s.VM, s.Session))
	}
	if err == nil {
		var names map[string]string
		names, err = m.layerOver(ctx, m.cfg.Registry.Dir(dst), s)
		if err == nil {
			err = m.persist(mc, func(r *registry.Record) { r.Disks = names })
		}
	}
	if err == nil {
		err = m.boot(ctx, mc, &startPoint{snap: s, state: state, fork: true})
	}
	if err != nil {
		_ = m.event(ctx, mc, EventFailed, err.Error())
		if derr := m.cfg.Registry.Delete(dst); derr != nil {
			err = errors.Join(err, derr)
		}
		m.forget(dst)
		return registry.Record{}, err
	}
	rec := mc.snapshot()
	m.log.Info("vm forked", "vm", dst, "from", src, "snapshot", s.Name, "pid", rec.Instance.PID)
	return rec, nil
}

// DeleteSnapshot removes a snapshot's state and manifest. A snapshot that
// a VM was forked from is kept while that VM exists: its session's
// lineage starts there. The frozen disk layers go only once no VM and no
// other snapshot stands on them.
func (m *Manager) DeleteSnapshot(ctx context.Context, vmName, snapName string) error {
	return m.locked(ctx, vmName, func(mc *machine) error {
		s, err := m.loadSnapshot(vmName, snapName)
		if err != nil && !errors.Is(err, ErrSnapshotDamaged) {
			return err
		}
		for _, o := range m.List() {
			if o.Origin != nil && o.Origin.Fork && o.Origin.VM == vmName && o.Origin.Snapshot == snapName {
				return fmt.Errorf("%w: %q was forked from snapshot %q of %q: delete %s first", ErrRunning, o.Name, snapName, vmName, o.Name)
			}
		}
		dir := filepath.Join(m.snapshotsOf(vmName), snapName)
		if err := os.RemoveAll(dir); err != nil {
			return fmt.Errorf("delete snapshot %q of %q: %w", snapName, vmName, err)
		}
		_ = atomicfile.SyncDir(m.snapshotsOf(vmName))
		m.collect(vmName)
		_ = m.eventSnap(ctx, mc, EventSnapshotDeleted, &s, fmt.Sprintf("snapshot %q deleted", snapName))
		m.log.Info("vm snapshot deleted", "vm", vmName, "snapshot", snapName)
		return nil
	})
}

// inUse returns every file some VM or snapshot reads: the chains under
// each VM's current disks and under each snapshot's layers. except, when
// not "", leaves out that VM's own disks and snapshots.
func (m *Manager) inUse(except string) map[string]string {
	used := map[string]string{} // file -> a VM that needs it
	for _, st := range m.List() {
		if st.Name == except {
			continue
		}
		dir := m.cfg.Registry.Dir(st.Name)
		for _, serial := range writableSerials {
			for _, n := range []string{diskName(st.Record, serial), st.PendingDisks[serial]} {
				if n == "" {
					continue
				}
				files, _ := chain(filepath.Join(dir, n))
				for _, f := range files {
					used[f] = st.Name
				}
			}
		}
		snaps, _ := m.Snapshots(st.Name)
		for _, s := range snaps {
			for _, d := range s.Disks {
				files, _ := chain(d.Path)
				for _, f := range files {
					used[f] = st.Name
				}
			}
		}
	}
	return used
}

// collect removes the disk files in vmName's directory that nothing uses
// any more: not its current disks, and not a layer under any VM's disks
// or any snapshot.
func (m *Manager) collect(vmName string) {
	dir := m.cfg.Registry.Dir(vmName)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	used := m.inUse("")
	for _, e := range ents {
		if e.IsDir() || !strings.HasSuffix(e.Name(), ".qcow2") {
			continue
		}
		p := filepath.Join(dir, e.Name())
		if _, ok := used[p]; ok {
			continue
		}
		if err := os.Remove(p); err == nil {
			m.log.Info("disk layer no longer used; removed", "vm", vmName, "file", e.Name())
		}
	}
}

// dependents names the VMs other than vmName whose disks or snapshots
// stand on files in vmName's directory.
func (m *Manager) dependents(vmName string) []string {
	dir := m.cfg.Registry.Dir(vmName) + string(filepath.Separator)
	var out []string
	for f, who := range m.inUse(vmName) {
		if strings.HasPrefix(f, dir) && !slices.Contains(out, who) {
			out = append(out, who)
		}
	}
	slices.Sort(out)
	return out
}

// reconcilePending settles a snapshot that a carreld died in. The state
// it was saving, in a ".tmp-" directory, is removed: the snapshot was never
// taken. For each disk, the overlay it was making is the VM's when the VM
// has it open, as its driver says (driver.DiskFiles); when the driver
// cannot say, or the VM is not running, when it exists over the old file
// (QEMU made it, and either writes it or writes the file under it, which
// the overlay shows through). Otherwise it is removed.
func (m *Manager) reconcilePending(ctx context.Context, rec *registry.Record) {
	dir := m.cfg.Registry.Dir(rec.Name)
	if ents, err := os.ReadDir(filepath.Join(dir, snapshotsDir)); err == nil {
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), tmpPrefix) {
				_ = os.RemoveAll(filepath.Join(dir, snapshotsDir, e.Name()))
				m.log.Warn("removed a snapshot a previous carreld did not finish", "vm", rec.Name, "snapshot", strings.TrimPrefix(e.Name(), tmpPrefix))
			}
		}
	}
	if len(rec.PendingDisks) == 0 {
		return
	}
	var open map[string]bool
	if df, ok := m.cfg.Driver.(driver.DiskFiles); ok && rec.Instance != nil {
		files, err := df.OpenDiskFiles(ctx, *rec.Instance)
		switch {
		case err == nil:
			open = map[string]bool{}
			for _, f := range files {
				open[f] = true
			}
		case !errors.Is(err, driver.ErrUnsupported) && !errors.Is(err, driver.ErrNotRunning):
			// Judged by the headers below, which keeps every write: at
			// worst the VM's next snapshot fails until it restarts.
			m.log.Warn("the driver cannot say which disk files the vm has open", "vm", rec.Name, "err", err)
		}
	}
	for serial, n := range rec.PendingDisks {
		p := filepath.Join(dir, n)
		var moved bool
		if open != nil {
			moved = open[p]
		} else {
			info, err := readQCOW2(p)
			moved = err == nil && info.Backing == filepath.Join(dir, diskName(*rec, serial))
		}
		if moved {
			if rec.Disks == nil {
				rec.Disks = map[string]string{}
			}
			rec.Disks[serial] = n
			continue
		}
		_ = os.Remove(p)
	}
	rec.PendingDisks = nil
	if err := m.cfg.Registry.Put(rec); err != nil {
		m.log.Error("settling an interrupted snapshot", "vm", rec.Name, "err", err)
	}
	m.log.Warn("settled the disks of a snapshot a previous carreld did not finish", "vm", rec.Name, "disks", rec.Disks)
}

// newMachineID is a random machine id (systemd's format: 128 bits, hex).
func newMachineID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	// A version 4 UUID's bits, as systemd-machine-id-setup makes them.
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return hex.EncodeToString(b[:])
}

// tellRestored tells a guest started from a snapshot that it was: the
// agent reseeds the kernel's RNG from a fresh host seed, sets the clock
// from the host's, and, in a fork, takes a new machine id. A guest that
// could not reseed fails the start: two machines running on from one
// snapshot must not share their random state.
func (m *Manager) tellRestored(ctx context.Context, link *agentlink.Link, from *startPoint) error {
	seed := make([]byte, 64)
	_, _ = rand.Read(seed)
	req := &agentv1.RestoredRequest{Seed: seed, UnixNanos: time.Now().UnixNano()}
	if from.fork {
		req.MachineId = newMachineID()
	}
	client, done := link.Agent()
	resp, err := client.Restored(ctx, connect.NewRequest(req))
	if err := done(ctx, err); err != nil {
		return fmt.Errorf("the guest agent was not told it was restored: %w", err)
	}
	detail := protocol.CleanText(resp.Msg.Detail, 512) // the guest's words
	if !resp.Msg.Reseeded {
		return fmt.Errorf("the guest could not reseed its random number generator: %s", detail)
	}
	if detail != "" {
		m.log.Warn("guest restored in part", "detail", detail)
	}
	return nil
}
