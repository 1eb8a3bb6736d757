// Package vm is carreld's VM manager: the state machine that creates,
// boots, stops and removes VMs through a driver, keeps their records, holds
// the link to each guest agent, and re-adopts running VMs after a restart.
// It also pauses and resumes VMs (pause.go), and snapshots, restores and
// forks them where the driver can (snapshot.go): disk layers frozen under
// new overlays, QEMU's state saved, both checked by digest before a start
// from them.
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

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/image/store"
	"github.com/carrel-os/carrel/supervisor/agentlink"
	"github.com/carrel-os/carrel/supervisor/console"
	"github.com/carrel-os/carrel/supervisor/driver"
	"github.com/carrel-os/carrel/supervisor/gpu"
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
	ErrClosing      = errors.New("carreld is shutting down")
	ErrPaused       = errors.New("vm is paused")
)

// Limits on create arguments.
const (
	MinMemory     = 128 << 20
	MaxMemory     = 1 << 40
	DefaultMemory = 512 << 20
	MaxCPUs       = 64
	// The guest refuses limits outside these (guest-agent/initsys).
	MinWorkspace = 16 << 20
	MaxWorkspace = 1 << 40
	MinProcesses = 16
	MaxProcesses = 1 << 22
	// The writable layer's disk (image/workspace's template bounds it).
	MinDisk = 64 << 20
	MaxDisk = 1 << 40
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
	// QEMUImg makes the VMs' own disks: workspace and writable layer
	// (default "qemu-img"; see image/workspace).
	QEMUImg string
	// DiskTemplate is where carreld keeps the template of the writable-
	// layer disks of VMs whose image brings none (image/workspace); it is
	// made when first needed.
	DiskTemplate string
	// Policies, when set, vets a policy name at create and rebind, and
	// gives each VM's guest the sandbox its policy derives once its agent
	// answers, before the VM counts as running (sandbox.go). A sandbox
	// that cannot be set fails the boot: a VM must not run without it.
	Policies Policies
	// OnEvent, when set, hears of every step in a VM's life (carreld
	// records them in the audit log). An error before QEMU starts
	// (EventCreated, EventStarting) stops the create or start.
	OnEvent func(ctx context.Context, ev Event) error
	// AgentLive, when set, is called as a VM goes live (booted, or adopted
	// after a carreld restart, when its agent may not answer yet) with a
	// context that ends when the VM stops or carreld lets go of it. It
	// must not block (carreld starts recording the guest's workspace
	// activity here).
	AgentLive func(live context.Context, v Live)
	// CheckGPUs, when set, vets the GPUs a VM is created with against the
	// host (supervisor/gpu.Host.Check); held maps every other VM to the
	// GPUs it holds. It runs under the manager's lock, so two creates
	// cannot claim one GPU. Without it, a create with GPUs is refused.
	CheckGPUs func(want []string, held map[string][]string) error
	// OnRemoved, when set, is told of each VM deleted (its name is free
	// again): carreld revokes the tokens scoped to it.
	OnRemoved func(name string)
}

// Live is a VM as it goes live, for Config.AgentLive.
type Live struct {
	Record registry.Record // as it went live
	Link   *agentlink.Link
	// Policy names the policy the VM is bound to now: carrel policy
	// apply may bind another while it runs.
	Policy func() string
}

// Manager owns every VM of one carreld.
type Manager struct {
	cfg Config
	log *slog.Logger

	templateMu sync.Mutex // makes DiskTemplate

	mu      sync.Mutex
	vms     map[string]*machine
	closing bool
	ops     sync.WaitGroup // lifecycle operations in flight
	// pausedFor, when set, is why every running VM is held paused
	// (PauseAll), since pausedAt.
	pausedFor string
	pausedAt  time.Time
	// expiryRecorded is, per VM, the expiry whose "expired" record is
	// written (ReapExpired).
	expiryRecorded map[string]time.Time
}

// machine is a VM's live state.
type machine struct {
	// op is held for a whole lifecycle operation (a one-slot semaphore, so
	// that waiting for it can give up when the caller's context ends).
	// Operations on different VMs run in parallel.
	op chan struct{}

	mu        sync.Mutex // guards the fields below
	rec       registry.Record
	removed   bool   // deleted while an operation waited for op
	cid       uint32 // vsock CID, held from allocation until the VM stops
	transport string // how the host reaches the agent
	link      *agentlink.Link
	console   *console.Recorder
	cancel    context.CancelFunc // ends the link's keepalive and watchers
	paused    bool               // by PauseAll
	// gpusOn is set from a run's recorded GPU attach until its detach. A
	// VM found starting, running or stopping after a restart has them.
	gpusOn bool
}

func newMachine(rec registry.Record) *machine {
	on := len(rec.GPUs) > 0 && rec.State != registry.StateCreating && rec.State != registry.StateStopped
	return &machine{op: make(chan struct{}, 1), rec: rec, gpusOn: on}
}

// lock takes mc's operation lock, or fails with ErrBusy once ctx ends, or
// ErrNotFound if the VM was deleted meanwhile.
func (mc *machine) lock(ctx context.Context) error {
	select {
	case mc.op <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("%w: %w", ErrBusy, ctx.Err())
	}
	mc.mu.Lock()
	removed := mc.removed
	mc.mu.Unlock()
	if removed {
		mc.unlock()
		return fmt.Errorf("%w: %q", ErrNotFound, mc.rec.Name)
	}
	return nil
}

func (mc *machine) unlock() { <-mc.op }

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

// begin registers a lifecycle operation; Close waits for it.
func (m *Manager) begin() (end func(), err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closing {
		return nil, ErrClosing
	}
	m.ops.Add(1)
	return m.ops.Done, nil
}

// CreateParams are the arguments of Create.
type CreateParams struct {
	Name        string
	Image       string
	MemoryBytes uint64
	CPUs        uint32
	Policy      string // must exist (Config.PolicyExists); "" is "default"
	// WorkspaceBytes sizes the guest's /workspace (0: half the memory);
	// MaxProcesses caps its commands' processes together (0: no cap).
	WorkspaceBytes uint64
	MaxProcesses   uint64
	// GPUs are PCI addresses of GPUs to pass through (Config.CheckGPUs).
	GPUs []string
	// Ephemeral keeps the VM's writable layer in memory: what it changes
	// outside /workspace is gone when it stops. DiskBytes caps the layer
	// otherwise (0: DefaultStateBytes).
	Ephemeral bool
	DiskBytes uint64
	// Env are KEY=VALUE pairs every command in the VM gets (under its
	// own), Labels find it, and TTL, when set, is how long it may live
	// from its creation before carreld ends it as ExpiryAction says
	// (registry.ExpireDelete, the default, or ExpireStop).
	Env          []string
	Labels       map[string]string
	TTL          time.Duration
	ExpiryAction string
}

func (p *CreateParams) validate() error {
	if err := protocol.ValidVMName(p.Name); err != nil {
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
	if p.Policy == "" {
		p.Policy = "default"
	}
	if p.CPUs > MaxCPUs {
		return fmt.Errorf("%w: %d cpus is out of range (1 to %d)", ErrInvalid, p.CPUs, MaxCPUs)
	}
	if w := p.WorkspaceBytes; w != 0 && (w < MinWorkspace || w > MaxWorkspace || w%(1<<20) != 0) {
		return fmt.Errorf("%w: workspace %d bytes: want whole MiB, %d MiB to %d GiB", ErrInvalid, w, MinWorkspace>>20, MaxWorkspace>>30)
	}
	if d := p.DiskBytes; d != 0 && (d < MinDisk || d > MaxDisk || d%(1<<20) != 0) {
		return fmt.Errorf("%w: disk %d bytes: want whole MiB, %d MiB to %d GiB", ErrInvalid, d, MinDisk>>20, MaxDisk>>30)
	}
	if p.Ephemeral && p.DiskBytes != 0 {
		return fmt.Errorf("%w: an ephemeral VM keeps its changes in memory: it has no disk to size", ErrInvalid)
	}
	if n := p.MaxProcesses; n != 0 && (n < MinProcesses || n > MaxProcesses) {
		return fmt.Errorf("%w: %d processes is out of range (%d to %d)", ErrInvalid, n, MinProcesses, MaxProcesses)
	}
	gpus, err := gpu.Canonical(p.GPUs)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	p.GPUs = gpus
	if err := validEnv(p.Env); err != nil {
		return err
	}
	if err := validLabels(p.Labels); err != nil {
		return err
	}
	return validExpiry(p.TTL, &p.ExpiryAction)
}

// Create defines a VM and boots it. It returns once the guest agent is
// ready. On any failure nothing is left behind: no QEMU, no record.
func (m *Manager) Create(ctx context.Context, p CreateParams) (registry.Record, error) {
	if err := p.validate(); err != nil {
		return registry.Record{}, err
	}
	if m.cfg.Policies != nil {
		if _, err := m.cfg.Policies.Get(p.Policy); err != nil {
			return registry.Record{}, fmt.Errorf("%w: %w", ErrInvalid, err)
		}
	}
	img, err := m.cfg.Images.Resolve(p.Image)
	if errors.Is(err, store.ErrNotFound) {
		return registry.Record{}, fmt.Errorf("%w %q: build it with `carrel image build --dev`", ErrImageMissing, p.Image)
	}
	if err != nil {
		return registry.Record{}, fmt.Errorf("resolve image %q: %w", p.Image, err)
	}
	end, err := m.begin()
	if err != nil {
		return registry.Record{}, err
	}
	defer end()
	mc := newMachine(registry.Record{
		Name:        p.Name,
		ID:          newID(),
		ImageDigest: img.Digest,
		RootHash:    rootHash(img),
		MemoryBytes: p.MemoryBytes,
		CPUs:        p.CPUs,
		Driver:      m.cfg.Driver.Name(),
		State:       registry.StateCreating,
		CreatedAt:   time.Now().UTC().Truncate(time.Millisecond),
		Policy:      p.Policy,
		Session:     newSession(), // the first run's

		WorkspaceBytes: p.WorkspaceBytes,
		MaxProcesses:   p.MaxProcesses,
		GPUs:           p.GPUs,
		Ephemeral:      p.Ephemeral,
		DiskBytes:      p.DiskBytes,
		Env:            p.Env,
		Labels:         p.Labels,
		ExpiryAction:   p.ExpiryAction,
	})
	if p.TTL > 0 {
		mc.rec.ExpiresAt = mc.rec.CreatedAt.Add(p.TTL)
	}
	mc.op <- struct{}{} // new, so free
	defer mc.unlock()
	m.mu.Lock()
	if _, ok := m.vms[p.Name]; ok {
		m.mu.Unlock()
		return registry.Record{}, fmt.Errorf("%w: %q", ErrExists, p.Name)
	}
	if err := m.checkGPUsLocked(p.GPUs); err != nil {
		m.mu.Unlock()
		return registry.Record{}, err
	}
	m.vms[p.Name] = mc
	m.mu.Unlock()

	// The record exists from here on, in state creating, so a crash mid-boot
	// is found and cleaned up by Reconcile.
	err = m.persist(mc, nil)
	if err == nil {
		err = m.event(ctx, mc, EventCreated, "")
	}
	if err == nil {
		err = m.boot(ctx, mc, nil)
	}
	if err != nil {
		m.gpusOff(ctx, mc, "create failed")
		_ = m.event(ctx, mc, EventFailed, err.Error())
		// Remove the record before the name is free again, so a new create
		// of the same name cannot lose its files to this cleanup.
		if derr := m.cfg.Registry.Delete(p.Name); derr != nil {
			err = errors.Join(err, derr)
		}
		m.forget(p.Name)
		return registry.Record{}, err
	}
	rec := mc.snapshot()
	m.log.Info("vm created", "vm", p.Name, "image", img.Digest, "pid", rec.Instance.PID)
	return rec, nil
}

func rootHash(img *store.Resolved) string {
	if v := img.Manifest.Verity; v != nil {
		return v.RootHash
	}
	return ""
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

// persist applies change to mc's record (if not nil) and writes it.
func (m *Manager) persist(mc *machine, change func(*registry.Record)) error {
	mc.mu.Lock()
	if change != nil {
		change(&mc.rec)
	}
	r := mc.rec
	mc.mu.Unlock()
	return m.cfg.Registry.Put(&r)
}

// boot starts the VM's QEMU and waits for its agent; from, when not nil,
// is a snapshot it starts from instead of booting. mc's op lock must be
// held, and its record must be in a transitional state (creating or
// starting). On success the VM is running and recorded so. On error no
// QEMU is left and the record has no instance; the caller decides what the
// VM becomes.
func (m *Manager) boot(ctx context.Context, mc *machine, from *startPoint) error {
	rec := mc.snapshot()
	name := rec.Name
	img, err := m.cfg.Images.Resolve(rec.ImageDigest)
	if err != nil {
		return fmt.Errorf("resolve image %s: %w", rec.ImageDigest, err)
	}
	ctx, cancel := context.WithTimeout(ctx, m.cfg.BootTimeout)
	defer cancel()
	spec := driver.Spec{
		Name:        name,
		Kernel:      img.KernelPath,
		Initrd:      img.InitrdPath,
		Cmdline:     img.Manifest.Cmdline + limitArgs(rec),
		MemoryBytes: rec.MemoryBytes,
		CPUs:        rec.CPUs,
		Dir:         m.cfg.Registry.Dir(name),
		Driver:      rec.Driver, // a VM keeps the driver it was created with
		GPUs:        rec.GPUs,
	}
	if err := m.attachDisks(ctx, rec, img, &spec); err != nil {
		return fmt.Errorf("boot vm %q: %w", name, err)
	}
	// The kernel drops what does not fit, silently: the words carreld
	// appended last (the writable layer, the workspace) would be lost.
	if n := len(spec.Cmdline); n > manifest.KernelCmdlineSize-64 {
		return fmt.Errorf("boot vm %q: the kernel command line would be %d bytes, over the %d the kernel keeps (less room for the driver's words): shorten the image's", name, n, manifest.KernelCmdlineSize-64)
	}
	// A new run (Create made the first one's), recorded before QEMU
	// starts.
	if rec.State != registry.StateCreating {
		if err := m.persist(mc, func(r *registry.Record) {
			r.Session = newSession()
			if from == nil {
				r.Origin = nil
			}
		}); err != nil {
			return err
		}
	}
	why := ""
	if from != nil {
		spec.Incoming = from.state
		spec.NoDataPort = !from.snap.DataPort
		why = fmt.Sprintf("from snapshot %q of %q, taken in session %s", from.snap.Name, from.snap.VM, from.snap.Session)
	}
	if err := m.event(ctx, mc, EventStarting, why); err != nil {
		return err
	}
	if err := m.gpusOnRecord(ctx, mc); err != nil {
		return err
	}
	if m.cfg.Vsock {
		spec.CID = m.allocCID(mc)
	}
	start := time.Now()
	inst, err := m.cfg.Driver.Start(ctx, spec)
	if err != nil {
		m.releaseCID(mc)
		return fmt.Errorf("boot vm %q: %w", name, err)
	}

	// From here on a failure must kill QEMU, and a carreld that dies must
	// find it again: record the instance before anything else.
	live, cancelLive := context.WithCancel(context.Background())
	var rc *console.Recorder
	fail := func(cause error) error {
		kerr := m.cfg.Driver.Kill(context.Background(), inst)
		msg := ""
		if rc != nil {
			// QEMU is gone, so the console reaches EOF after its last bytes.
			<-waitOrTimeout(rc.Done(), 2*time.Second)
			if tail := rc.Tail(20); tail != "" {
				msg = "\n--- last lines of the serial console ---\n" + tail
			}
			if l := rc.LastLineWith(protocol.BootFailedMarker); l != "" {
				msg = "\nthe guest says: " + l + msg
			}
		}
		cancelLive()
		m.releaseCID(mc)
		perr := m.persist(mc, func(r *registry.Record) { r.Instance = nil })
		return errors.Join(fmt.Errorf("boot vm %q: %w%s", name, cause, msg), kerr, perr)
	}
	if err := m.persist(mc, func(r *registry.Record) { r.Instance = &inst }); err != nil {
		return fail(err)
	}
	rc, err = console.Record(live, m.cfg.Driver.ConsoleDialer(inst), filepath.Join(spec.Dir, console.LogName))
	if err != nil {
		return fail(err)
	}
	dial, transport := m.cfg.Driver.AgentDialer(inst)
	link := agentlink.New(dial, m.cfg.Logger.With("vm", name, "transport", transport))
	link.UseDataPort(driver.DataDialer(inst))
	exited := m.watchExit(live, inst)
	if err := m.cfg.Driver.Resume(ctx, inst); err != nil {
		link.Close()
		return fail(err)
	}
	// Ready is the first answered health probe; a QEMU that exits (kernel
	// panic with -no-reboot, say) ends the wait at once.
	readyErr := make(chan error, 1)
	go func() {
		if from != nil {
			// The agent runs already, but holds the session it had at the
			// snapshot until it reads that the host left (see
			// restoredSettle); then short attempts.
			t := time.Now()
			select {
			case <-ctx.Done():
			case <-time.After(restoredSettle):
			}
			err := link.WaitReadyEvery(ctx, restoredAttempt)
			m.log.Debug("restored guest's agent answered", "vm", name, "took", time.Since(t), "err", err)
			readyErr <- err
			return
		}
		readyErr <- link.WaitReady(ctx)
	}()
	select {
	case err = <-readyErr:
	case <-exited:
		err = errors.New("qemu exited before the guest agent became ready")
	}
	if err == nil && from != nil {
		err = m.tellRestored(ctx, link, from)
	}
	if err == nil {
		err = m.giveSandbox(ctx, mc.snapshot(), link)
	}
	if err != nil {
		link.Close()
		return fail(err)
	}
	if err := m.persist(mc, func(r *registry.Record) {
		r.State = registry.StateRunning
		r.LastError = ""
	}); err != nil {
		link.Close()
		return fail(err)
	}
	boot := time.Since(start).Round(time.Millisecond)
	m.log.Info("guest agent ready", "vm", name, "transport", transport, "boot", boot)
	m.attach(live, cancelLive, mc, inst, link, rc, transport, exited)
	_ = m.event(ctx, mc, EventStarted, "agent ready after "+boot.String())
	m.pauseIfHeld(ctx, mc)
	return nil
}

// watchExit returns a channel closed when inst's process exits. A failure
// to watch (not an exit) is logged and leaves the channel open.
func (m *Manager) watchExit(ctx context.Context, inst driver.Instance) <-chan struct{} {
	ch := make(chan struct{})
	go func() {
		err := m.cfg.Driver.Wait(ctx, inst)
		if err == nil {
			close(ch)
			return
		}
		if ctx.Err() == nil {
			m.log.Error("cannot watch vm process; its exit will not be noticed", "pid", inst.PID, "err", err)
		}
	}()
	return ch
}

// attach makes a booted or adopted VM live: its link, console, keepalive
// and exit watcher.
func (m *Manager) attach(live context.Context, cancel context.CancelFunc, mc *machine, inst driver.Instance,
	link *agentlink.Link, rc *console.Recorder, transport string, exited <-chan struct{}) {
	mc.mu.Lock()
	mc.link, mc.console, mc.cancel, mc.transport = link, rc, cancel, transport
	mc.mu.Unlock()
	m.holdLink(live, mc) // an adopted VM may be paused
	go link.Keepalive(live, agentlink.KeepaliveInterval)
	go func() {
		select {
		case <-live.Done():
		case <-exited:
			m.exitedOnItsOwn(mc, inst)
		}
	}()
	if m.cfg.AgentLive != nil {
		m.cfg.AgentLive(live, Live{Record: mc.snapshot(), Link: link, Policy: mc.policy})
	}
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

// exitedOnItsOwn records a VM whose QEMU ended without a Stop (guest
// powered off, crashed, or was killed from outside).
func (m *Manager) exitedOnItsOwn(mc *machine, inst driver.Instance) {
	if err := mc.lock(context.Background()); err != nil {
		return // deleted meanwhile
	}
	defer mc.unlock()
	rec := mc.snapshot()
	if rec.State != registry.StateRunning || rec.Instance == nil || rec.Instance.PID != inst.PID {
		return // Stop or Delete handled it
	}
	// "stopped" must mean no QEMU: make sure, even if the exit was a false
	// alarm. Kill is a no-op when the process is gone.
	kerr := m.cfg.Driver.Kill(context.Background(), inst)
	tail := ""
	mc.mu.Lock()
	rc := mc.console
	mc.mu.Unlock()
	if rc != nil {
		<-waitOrTimeout(rc.Done(), time.Second)
		tail = rc.Tail(5)
	}
	m.log.Warn("vm exited on its own", "vm", rec.Name, "pid", inst.PID, "kill_err", kerr)
	m.markStopped(mc, EventStopped, "vm exited without a stop request; last console lines: "+tail)
}

// markStopped moves mc to stopped, persists it and tells OnEvent (kind
// EventStopped or EventFailed).
func (m *Manager) markStopped(mc *machine, kind EventKind, lastErr string) {
	mc.detach()
	m.releaseCID(mc)
	m.gpusOff(context.Background(), mc, string(kind))
	if err := m.persist(mc, func(r *registry.Record) {
		r.State = registry.StateStopped
		r.Instance = nil
		r.LastError = lastErr
		r.Paused, r.PausedAt = false, time.Time{}
	}); err != nil {
		m.log.Error("persist stopped vm", "vm", mc.rec.Name, "err", err)
	}
	_ = m.event(context.Background(), mc, kind, lastErr)
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
	mc.console = nil
	mc.paused = false
}

// policy names the policy mc is bound to now.
func (mc *machine) policy() string {
	mc.mu.Lock()
	defer mc.mu.Unlock()
	return mc.rec.PolicyName()
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

// allocCID gives mc the lowest guest CID no other VM holds (3 and up; 0-2
// are reserved).
func (m *Manager) allocCID(mc *machine) uint32 {
	m.mu.Lock()
	defer m.mu.Unlock()
	used := map[uint32]bool{}
	for _, o := range m.vms {
		if o == mc {
			continue
		}
		o.mu.Lock()
		used[o.cid] = true
		o.mu.Unlock()
	}
	cid := uint32(3)
	for used[cid] {
		cid++
	}
	mc.mu.Lock()
	mc.cid = cid
	mc.mu.Unlock()
	return cid
}

func (m *Manager) releaseCID(mc *machine) {
	mc.mu.Lock()
	mc.cid = 0
	mc.mu.Unlock()
}

func consoleRecord(ctx context.Context, m *Manager, inst driver.Instance, name string) (*console.Recorder, error) {
	return console.Record(ctx, m.cfg.Driver.ConsoleDialer(inst), filepath.Join(m.cfg.Registry.Dir(name), console.LogName))
}
