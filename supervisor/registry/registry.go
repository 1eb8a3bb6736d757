// Package registry persists VM records under carreld's state directory, one
// directory per VM (<dir>/<name>/vm.json). Writes are atomic: a crash leaves
// either the old record or the new one, never a torn file.
package registry

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/atomicfile"
	"github.com/carrel-os/carrel/supervisor/driver"
)

// State is a VM's lifecycle state.
type State string

// States. After a restart, a record in StateCreating belongs to a create
// that never finished (reconcile removes it) and one in StateStarting to a
// start that never finished (reconcile stops it).
const (
	StateCreating State = "creating"
	StateStarting State = "starting"
	StateRunning  State = "running"
	StateStopping State = "stopping"
	StateStopped  State = "stopped"
)

// ErrNotFound means no VM has that name.
var ErrNotFound = errors.New("no such vm")

// Record is everything carreld keeps about one VM.
type Record struct {
	Name        string `json:"name"`
	ID          string `json:"id"`
	ImageDigest string `json:"image_digest"`
	// RootHash is the dm-verity root hash of the image's root file system
	// (hex), "" for an image without one.
	RootHash    string    `json:"root_hash,omitempty"`
	MemoryBytes uint64    `json:"memory_bytes"`
	CPUs        uint32    `json:"cpus"`
	Driver      string    `json:"driver"`
	State       State     `json:"state"`
	CreatedAt   time.Time `json:"created_at"`
	// Instance locates the running VM; nil when stopped.
	Instance *driver.Instance `json:"instance,omitempty"`
	// LastError says why the VM stopped when it stopped on its own.
	LastError string `json:"last_error,omitempty"`
	// Policy names the policy bound to the VM. Records written before
	// policies existed have none and get the default.
	Policy string `json:"policy,omitempty"`
	// Session names the VM's current run (its latest one when stopped):
	// "ses_" and 16 hex digits, new at every boot. Audit records of the
	// run carry it.
	Session string `json:"session,omitempty"`
	// Limits the guest applies (its kernel command line carries them); 0
	// is no limit.
	WorkspaceBytes uint64 `json:"workspace_bytes,omitempty"`
	MaxProcesses   uint64 `json:"max_processes,omitempty"`
	// GPUs are the PCI addresses of the GPUs passed through to the VM. It
	// holds them, running or stopped, until it is deleted.
	GPUs []string `json:"gpus,omitempty"`
	// Ephemeral VMs keep their writable layer in memory; DiskBytes sizes
	// it on disk otherwise (0: the default).
	Ephemeral bool   `json:"ephemeral,omitempty"`
	DiskBytes uint64 `json:"disk_bytes,omitempty"`
	// Paused is set while an operator holds the running VM's vCPUs
	// stopped (carrel vm pause), since PausedAt. carreld keeps it so
	// across restarts; a stop clears it.
	Paused   bool      `json:"paused,omitempty"`
	PausedAt time.Time `json:"paused_at,omitzero"`
	// Disks names the files of the VM's writable disks in its directory,
	// by serial, where they are not the first ones (vm.StateDiskName,
	// vm.WorkspaceDiskName): a snapshot freezes the files the VM had and
	// moves it to new overlays over them, a restore or reset to new ones.
	Disks map[string]string `json:"disks,omitempty"`
	// PendingDisks are the overlays a snapshot is moving the VM to, named
	// before QEMU makes them: a carreld that dies mid-snapshot finds out
	// from them which files the VM writes (vm.Manager.Reconcile).
	PendingDisks map[string]string `json:"pending_disks,omitempty"`
	// Origin names the snapshot the VM's current run started from (a
	// restore, or the fork that made it); nil for a run that booted.
	Origin *Origin `json:"origin,omitempty"`
	// Env are KEY=VALUE pairs every command started in the VM gets, under
	// its own; Labels find the VM (ListVMs filters on them).
	Env    []string          `json:"env,omitempty"`
	Labels map[string]string `json:"labels,omitempty"`
	// ExpiresAt, when set, is when carreld ends the VM on its own:
	// ExpiryAction says how ("delete" or "stop"; "" is delete).
	ExpiresAt    time.Time `json:"expires_at,omitzero"`
	ExpiryAction string    `json:"expiry_action,omitempty"`
}

// What carreld does to a VM whose time is up (Record.ExpiryAction).
const (
	ExpireDelete = "delete"
	ExpireStop   = "stop"
)

// Origin is where a run started from: a snapshot of a VM (this one, or
// the one it was forked from), taken in that VM's session Session.
type Origin struct {
	VM       string `json:"vm"`
	Snapshot string `json:"snapshot"`
	Session  string `json:"session"`
	// Fork is set for a VM made by forking.
	Fork bool `json:"fork,omitempty"`
}

// PolicyName is the VM's bound policy, "default" when none was recorded.
func (r *Record) PolicyName() string {
	if r.Policy == "" {
		return "default"
	}
	return r.Policy
}

// maxRecordBytes caps a record file; anything larger is corrupt.
const maxRecordBytes = 1 << 20

// Registry stores records in a directory.
type Registry struct {
	dir string
}

// Open returns the registry rooted at dir, creating it if needed.
func Open(dir string) (*Registry, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create vm registry: %w", err)
	}
	return &Registry{dir: dir}, nil
}

// Dir returns the directory of the VM called name, which holds its record,
// sockets and logs.
func (r *Registry) Dir(name string) string { return filepath.Join(r.dir, name) }

// Put writes rec atomically, creating the VM's directory if needed.
func (r *Registry) Put(rec *Record) error {
	if err := protocol.ValidVMName(rec.Name); err != nil {
		return err
	}
	dir := r.Dir(rec.Name)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create vm dir: %w", err)
	}
	b, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return fmt.Errorf("encode vm %q: %w", rec.Name, err)
	}
	path := filepath.Join(dir, "vm.json")
	if err := atomicfile.WriteFile(path, append(b, '\n'), 0o600); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// Get reads the record of the VM called name.
func (r *Registry) Get(name string) (*Record, error) {
	if err := protocol.ValidVMName(name); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNotFound, err)
	}
	path := filepath.Join(r.Dir(name), "vm.json")
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%w: %q", ErrNotFound, name)
	}
	if err != nil {
		return nil, fmt.Errorf("read vm %q: %w", name, err)
	}
	defer f.Close()
	var rec Record
	dec := json.NewDecoder(&limitedReader{f, maxRecordBytes})
	if err := dec.Decode(&rec); err != nil {
		return nil, fmt.Errorf("decode %s: %w", path, err)
	}
	if rec.Name != name {
		return nil, fmt.Errorf("decode %s: record names %q", path, rec.Name)
	}
	return &rec, nil
}

type limitedReader struct {
	f *os.File
	n int64
}

func (l *limitedReader) Read(p []byte) (int, error) {
	if l.n <= 0 {
		return 0, errors.New("record too large")
	}
	if int64(len(p)) > l.n {
		p = p[:l.n]
	}
	n, err := l.f.Read(p)
	l.n -= int64(n)
	return n, err
}

// List returns all records sorted by name. Unreadable records are returned
// as errors joined together, alongside the readable ones.
func (r *Registry) List() ([]*Record, error) {
	ents, err := os.ReadDir(r.dir)
	if err != nil {
		return nil, fmt.Errorf("list vms: %w", err)
	}
	var recs []*Record
	var errs []error
	for _, e := range ents {
		if !e.IsDir() || protocol.ValidVMName(e.Name()) != nil {
			continue
		}
		rec, err := r.Get(e.Name())
		if errors.Is(err, ErrNotFound) {
			continue // a directory whose record was never written
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		recs = append(recs, rec)
	}
	sort.Slice(recs, func(i, j int) bool { return recs[i].Name < recs[j].Name })
	return recs, errors.Join(errs...)
}

// Delete removes the VM's directory and everything in it. It returns nil
// if the VM does not exist.
func (r *Registry) Delete(name string) error {
	if err := protocol.ValidVMName(name); err != nil {
		return err
	}
	if err := os.RemoveAll(r.Dir(name)); err != nil {
		return fmt.Errorf("delete vm %q: %w", name, err)
	}
	return nil
}
