// Package vm is carreld's VM manager: the state machine that creates,
// boots, stops and removes VMs through a driver, keeps their records, holds
// the link to each guest agent, and re-adopts running VMs after a restart.
package vm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"time"

	"github.com/carrel-os/carrel/image/store"
	"github.com/carrel-os/carrel/supervisor/agentlink"
	"github.com/carrel-os/carrel/supervisor/console"
	"github.com/carrel-os/carrel/supervisor/driver"
	"github.com/carrel-os/carrel/supervisor/registry"
)

// Errors callers branch on.
var (
	ErrExists       = errors.New("vm already exists")
	ErrNotFound     = registry.ErrNotFound
	ErrInvalid      = errors.New("invalid argument")
	ErrNotRunning   = errors.New("vm is not running")
	ErrRunning      = errors.New("vm is running")
	ErrBusy         = errors.New("vm is busy with another operation")
	ErrImageMissing = errors.New("unknown image")
)

// Limits on create arguments.
const (
	MinMemory     = 128 << 20
	MaxMemory     = 1 << 40
	DefaultMemory = 512 << 20
	MaxCPUs       = 64
)

// Config configures a Manager.
type Config struct {
	Registry *registry.Registry
	Images   *store.Store
	Driver   driver.Driver
	Logger   *slog.Logger
	// BootTimeout bounds a boot, from QEMU start to agent ready.
	BootTimeout time.Duration
	// StopTimeout is how long a guest gets to power off before it is
	// killed.
	StopTimeout time.Duration
	// Vsock says whether the host has /dev/vhost-vsock; without it VMs
	// get no vsock device and the agent is reached over virtio-serial.
	Vsock bool
}

// Manager owns every VM of one carreld.
type Manager struct {
	cfg Config
	log *slog.Logger

	mu  sync.Mutex
	vms map[string]*machine
}

// machine is a VM's live state. Its mutex serializes lifecycle operations
// on that VM; ops on different VMs run in parallel.
type machine struct {
	op sync.Mutex // held for a whole lifecycle operation

	mu      sync.Mutex // guards the fields below
	rec     registry.Record
	link    *agentlink.Link
	console *console.Recorder
	cancel  context.CancelFunc // ends the link's keepalive and watchers
}

// New returns a manager. Call Reconcile before serving.
func New(cfg Config) *Manager {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.BootTimeout == 0 {
		cfg.BootTimeout = 90 * time.Second
	}
	if cfg.StopTimeout == 0 {
		cfg.StopTimeout = 30 * time.Second
	}
	return &Manager{cfg: cfg, log: cfg.Logger.With("subsystem", "vm"), vms: map[string]*machine{}}
}

// CreateParams are the arguments of Create.
type CreateParams struct {
	Name        string
	Image       string
	MemoryBytes uint64
	CPUs        uint32
}

func (p *CreateParams) validate() error {
	if err := registry.ValidName(p.Name); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if p.Image == "" {
		return fmt.Errorf("%w: an image is required", ErrInvalid)
	}
	if p.MemoryBytes == 0 {
		p.MemoryBytes = DefaultMemory
	}
	if p.MemoryBytes < MinMemory || p.MemoryBytes > MaxMemory {
		return fmt.Errorf("%w: memory %d MiB is out of range (%d MiB to %d GiB)", ErrInvalid, p.MemoryBytes>>20, MinMemory>>20, MaxMemory>>30)
	}
	if p.MemoryBytes%(1<<20) != 0 {
		return fmt.Errorf("%w: memory must be a whole number of MiB", ErrInvalid)
	}
	if p.CPUs == 0 {
		p.CPUs = 1
	}
	if p.CPUs > MaxCPUs {
		return fmt.Errorf("%w: %d cpus is out of range (1 to %d)", ErrInvalid, p.CPUs, MaxCPUs)
	}
	return nil
}

// Create defines a VM and boots it. It returns once the guest agent is
// ready. On any failure nothing is left behind: no QEMU, no record.
func (m *Manager) Create(ctx context.Context, p CreateParams) (registry.Record, error) {
	if err := p.validate(); err != nil {
		return registry.Record{}, err
	}
	img, err := m.cfg.Images.Resolve(p.Image)
	if errors.Is(err, store.ErrNotFound) {
		return registry.Record{}, fmt.Errorf("%w %q: build it with `carrel image build --dev`", ErrImageMissing, p.Image)
	}
	if err != nil {
		return registry.Record{}, fmt.Errorf("resolve image %q: %w", p.Image, err)
	}
	mc := &machine{rec: registry.Record{
		Name:        p.Name,
		ID:          newID(),
		ImageDigest: img.Digest,
		MemoryBytes: p.MemoryBytes,
		CPUs:        p.CPUs,
		Driver:      m.cfg.Driver.Name(),
		State:       registry.StateCreating,
		CreatedAt:   time.Now().UTC().Truncate(time.Millisecond),
	}}
	mc.op.Lock()
	defer mc.op.Unlock()
	m.mu.Lock()
	if _, ok := m.vms[p.Name]; ok {
		m.mu.Unlock()
		return registry.Record{}, fmt.Errorf("%w: %q", ErrExists, p.Name)
	}
	m.vms[p.Name] = mc
	m.mu.Unlock()

	// The record exists from here on, in state creating, so a crash mid-boot
	// is found and cleaned up by Reconcile.
	if err := m.cfg.Registry.Put(&mc.rec); err != nil {
		m.forget(p.Name)
		return registry.Record{}, err
	}
	if err := m.boot(ctx, mc); err != nil {
		m.forget(p.Name)
		if derr := m.cfg.Registry.Delete(p.Name); derr != nil {
			err = errors.Join(err, derr)
		}
		return registry.Record{}, err
	}
	m.log.Info("vm created", "vm", p.Name, "image", img.Digest, "pid", mc.rec.Instance.PID)
	return mc.snapshot(), nil
}

func (m *Manager) forget(name string) {
	m.mu.Lock()
	delete(m.vms, name)
	m.mu.Unlock()
}

func newID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// boot starts the VM's QEMU and waits for its agent. mc.op must be held. On
// error the VM is not running and mc.rec is unchanged.
func (m *Manager) boot(ctx context.Context, mc *machine) error {
	name := mc.rec.Name
	img, err := m.cfg.Images.Resolve(mc.rec.ImageDigest)
	if err != nil {
		return fmt.Errorf("resolve image %s: %w", mc.rec.ImageDigest, err)
	}
	ctx, cancel := context.WithTimeout(ctx, m.cfg.BootTimeout)
	defer cancel()
	spec := driver.Spec{
		Name:        name,
		Kernel:      img.KernelPath,
		Initrd:      img.InitrdPath,
		Cmdline:     img.Manifest.Cmdline,
		MemoryBytes: mc.rec.MemoryBytes,
		CPUs:        mc.rec.CPUs,
		Dir:         m.cfg.Registry.Dir(name),
	}
	if m.cfg.Vsock {
		cid, err := m.allocCID(name)
		if err != nil {
			return err
		}
		spec.CID = cid
	}
	start := time.Now()
	inst, err := m.cfg.Driver.Start(ctx, spec)
	if err != nil {
		return fmt.Errorf("boot vm %q: %w", name, err)
	}
	// From here on a failure must kill QEMU.
	live, cancelLive := context.WithCancel(context.Background())
	fail := func(err error, rec *console.Recorder) error {
		cancelLive()
		kerr := m.cfg.Driver.Kill(context.Background(), inst)
		msg := ""
		if rec != nil {
			<-waitOrTimeout(rec.Done(), time.Second)
			if tail := rec.Tail(20); tail != "" {
				msg = "\n--- last lines of the serial console ---\n" + tail
			}
		}
		return errors.Join(fmt.Errorf("boot vm %q: %w%s", name, err, msg), kerr)
	}
	rec, err := consoleRecord(live, m, inst, name)
	if err != nil {
		return fail(err, nil)
	}
	dial, transport := m.cfg.Driver.AgentDialer(inst)
	link := agentlink.New(dial, m.cfg.Logger.With("vm", name, "transport", transport))
	if err := m.cfg.Driver.Resume(ctx, inst); err != nil {
		link.Close()
		return fail(err, rec)
	}
	// Ready is the first answered health probe; a QEMU that exits (kernel
	// panic with -no-reboot, say) ends the wait at once.
	exited := make(chan error, 1)
	go func() { exited <- m.cfg.Driver.Wait(live, inst) }()
	readyErr := make(chan error, 1)
	go func() { readyErr <- link.WaitReady(ctx) }()
	select {
	case err = <-readyErr:
	case <-exited:
		err = errors.New("qemu exited before the guest agent became ready")
	}
	if err != nil {
		link.Close()
		return fail(err, rec)
	}
	m.log.Info("guest agent ready", "vm", name, "transport", transport, "boot", time.Since(start).Round(time.Millisecond))

	mc.mu.Lock()
	mc.rec.State = registry.StateRunning
	mc.rec.Instance = &inst
	mc.rec.LastError = ""
	mc.link, mc.console, mc.cancel = link, rec, cancelLive
	r := mc.rec
	mc.mu.Unlock()
	if err := m.cfg.Registry.Put(&r); err != nil {
		mc.detach()
		return fail(err, rec)
	}
	m.watch(live, mc, inst, exited)
	return nil
}

func waitOrTimeout(ch <-chan struct{}, d time.Duration) <-chan struct{} {
	out := make(chan struct{})
	go func() {
		select {
		case <-ch:
		case <-time.After(d):
		}
		close(out)
	}()
	return out
}

// watch keeps the link alive and notices the VM's exit.
func (m *Manager) watch(ctx context.Context, mc *machine, inst driver.Instance, exited <-chan error) {
	mc.mu.Lock()
	link := mc.link
	mc.mu.Unlock()
	go link.Keepalive(ctx, agentlink.KeepaliveInterval)
	go func() {
		select {
		case <-ctx.Done():
			return
		case <-exited:
		}
		m.exitedOnItsOwn(mc, inst)
	}()
}

// exitedOnItsOwn records a VM whose QEMU ended without a Stop (guest
// powered off, crashed, or was killed from outside).
func (m *Manager) exitedOnItsOwn(mc *machine, inst driver.Instance) {
	mc.op.Lock()
	defer mc.op.Unlock()
	mc.mu.Lock()
	if mc.rec.State != registry.StateRunning || mc.rec.Instance == nil || mc.rec.Instance.PID != inst.PID {
		mc.mu.Unlock()
		return // Stop or Delete is handling it
	}
	mc.mu.Unlock()
	tail := ""
	if mc.console != nil {
		<-waitOrTimeout(mc.console.Done(), time.Second)
		tail = mc.console.Tail(5)
	}
	m.log.Warn("vm exited on its own", "vm", mc.rec.Name, "pid", inst.PID)
	m.markStopped(mc, "vm exited without a stop request; console: "+tail)
}

// markStopped moves mc to stopped and persists it.
func (m *Manager) markStopped(mc *machine, lastErr string) {
	mc.detach()
	mc.mu.Lock()
	mc.rec.State = registry.StateStopped
	mc.rec.Instance = nil
	mc.rec.LastError = lastErr
	r := mc.rec
	mc.mu.Unlock()
	if err := m.cfg.Registry.Put(&r); err != nil {
		m.log.Error("persist stopped vm", "vm", r.Name, "err", err)
	}
}

// detach drops the link, console and watchers.
func (mc *machine) detach() {
	mc.mu.Lock()
	defer mc.mu.Unlock()
	if mc.cancel != nil {
		mc.cancel()
		mc.cancel = nil
	}
	if mc.link != nil {
		mc.link.Close()
		mc.link = nil
	}
}

func (mc *machine) snapshot() registry.Record {
	mc.mu.Lock()
	defer mc.mu.Unlock()
	r := mc.rec
	if r.Instance != nil {
		inst := *r.Instance
		r.Instance = &inst
	}
	return r
}

// allocCID picks the lowest free guest CID (3 and up; 0-2 are reserved).
func (m *Manager) allocCID(name string) (uint32, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	used := map[uint32]bool{}
	for n, mc := range m.vms {
		if n == name {
			continue
		}
		mc.mu.Lock()
		if mc.rec.Instance != nil {
			used[mc.rec.Instance.CID] = true
		}
		mc.mu.Unlock()
	}
	for cid := uint32(3); cid < 1<<31; cid++ {
		if !used[cid] {
			return cid, nil
		}
	}
	return 0, errors.New("no free vsock cid")
}

func consoleRecord(ctx context.Context, m *Manager, inst driver.Instance, name string) (*console.Recorder, error) {
	return console.Record(ctx, m.cfg.Driver.ConsoleDialer(inst), filepath.Join(m.cfg.Registry.Dir(name), "console.log"))
}
