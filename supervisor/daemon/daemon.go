// Package daemon wires carreld together: state directory, image store, VM
// manager, public API and systemd integration.
package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/image/debian"
	"github.com/carrel-os/carrel/image/devimage"
	"github.com/carrel-os/carrel/image/store"
	"github.com/carrel-os/carrel/image/workspace"
	"github.com/carrel-os/carrel/supervisor/accel"
	"github.com/carrel-os/carrel/supervisor/activity"
	"github.com/carrel-os/carrel/supervisor/api"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/e2b"
	"github.com/carrel-os/carrel/supervisor/egress"
	"github.com/carrel-os/carrel/supervisor/fence"
	"github.com/carrel-os/carrel/supervisor/gpu"
	"github.com/carrel-os/carrel/supervisor/guestreq"
	"github.com/carrel-os/carrel/supervisor/identity"
	"github.com/carrel-os/carrel/supervisor/policystore"
	"github.com/carrel-os/carrel/supervisor/recorder"
	"github.com/carrel-os/carrel/supervisor/registry"
	"github.com/carrel-os/carrel/supervisor/systemd"
	"github.com/carrel-os/carrel/supervisor/vm"
)

// Version is set at build time with -ldflags.
var Version = "dev"

// Config is carreld's configuration.
type Config struct {
	StateDir string
	Socket   string
	// CacheDir holds downloaded packages for image builds.
	CacheDir string
	// AgentBinary is the static carrel-agent put into dev images.
	AgentBinary string
	QEMUBinary  string
	// JailQEMU runs each of the qemu driver's QEMUs as an unprivileged
	// user of its own in a jail (qemu.Jail), the users from JailUIDBase
	// (0: qemu.DefaultUIDBase). carreld must be root; the binary that
	// runs carreld must call jail.Main first.
	JailQEMU    bool
	JailUIDBase uint32
	// Machine is the QEMU machine type: auto, microvm or q35.
	Machine string
	// Driver runs new VMs: DriverQEMU (the default) or DriverLibvirt.
	// Existing VMs keep the driver they were created with.
	Driver string
	// LibvirtURI is the libvirt connection (default qemu:///system).
	LibvirtURI  string
	BootTimeout time.Duration
	// EgressHosts, when set, is a hosts(5) file that resolves the names
	// VMs reach through the egress proxy, instead of DNS.
	EgressHosts string
	// ImportImages are image directories (image/imagedir) imported when
	// carreld starts, each tagged with its manifest's name: the images a
	// NixOS host declares (services.carreld.images). An image already
	// stored is left as it is.
	ImportImages []string
	Logger       *slog.Logger
	// E2BListen, when set, is the TCP address the e2b API is served on
	// (supervisor/e2b): its control plane and its sandboxes' envd, for
	// unmodified e2b SDKs. E2BMaxUpload caps one file upload there (0:
	// e2b.DefaultMaxUpload).
	E2BListen    string
	E2BMaxUpload int64
	// AuditOrigin names a new audit log's key and its checkpoints' origin
	// ("" is audit.KeyName): give each host its own, for witnesses that
	// serve several.
	AuditOrigin string
	// AuditSegmentBytes and AuditSegmentAge bound the audit log's live
	// segment before it rolls over (audit.Options; 0: the defaults).
	AuditSegmentBytes int64
	AuditSegmentAge   time.Duration
	// Witnesses cosign the audit log's checkpoints: "URL,KEY" each, the
	// witness's C2SP tlog-witness URL and its cosignature/v1 verifier key.
	Witnesses []string
	// Fleet, when set, makes carreld a node of a Kubernetes fleet.
	Fleet *FleetConfig
}

// Run serves until ctx ends. VMs keep running after it returns.
func Run(ctx context.Context, cfg Config) error {
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
		return fmt.Errorf("create state dir: %w", err)
	}
	unlock, err := lockStateDir(cfg.StateDir)
	if err != nil {
		return err
	}
	defer unlock()

	images, err := store.Open(filepath.Join(cfg.StateDir, "images"))
	if err != nil {
		return err
	}
	importImages(images, cfg.ImportImages, log)
	reg, err := registry.Open(filepath.Join(cfg.StateDir, "vms"))
	if err != nil {
		return err
	}
	acc := accel.Detect()
	log.Info("accelerator chosen", "accel", acc.Name, "reason", acc.Reason)
	_, vsockErr := os.Stat("/dev/vhost-vsock")
	vsock := vsockErr == nil
	if !vsock {
		log.Info("no /dev/vhost-vsock: guest agents are reached over virtio-serial")
	}
	drv, closeDrivers, err := newDrivers(ctx, cfg, acc.Name, log)
	if err != nil {
		return err
	}
	defer closeDrivers()
	pols, err := policystore.Open(ctx, filepath.Join(cfg.StateDir, "policies"), log.With("subsystem", "policy"))
	if err != nil {
		return err
	}
	// Every decision is on record before the action it admits: the api
	// decision precedes every call, so no call goes ahead unrecorded.
	faults := newFaultHandler(log)
	witnesses, err := witnessPusher(cfg.Witnesses, log)
	if err != nil {
		return err
	}
	var onCheckpoint func(audit.Checkpoint)
	if witnesses != nil {
		onCheckpoint = witnesses.Checkpoint
	}
	auditLog, err := openAudit(filepath.Join(cfg.StateDir, "audit"), cfg, log, faults, onCheckpoint)
	if err != nil {
		return err
	}
	if witnesses != nil {
		if err := startWitnesses(ctx, witnesses, auditLog); err != nil {
			return err
		}
	}
	defer auditLog.Close()
	rec := recorder.New(auditLog, log)
	pols.Record = rec.Decision
	tokens, err := identity.OpenTokens(filepath.Join(cfg.StateDir, "tokens.json"))
	if err != nil {
		return err
	}
	// Each live VM's workspace activity, as its agent reports it, is
	// recorded until the VM stops or carreld lets go of it (mgr.Close),
	// and before the audit log closes.
	var recordings sync.WaitGroup
	defer recordings.Wait()
	// Each live VM's egress, its only way out, decided per connection by
	// its policy at the time (the manager names it).
	eg, err := newEgress(cfg.EgressHosts, pols, auditLog, log)
	if err != nil {
		return err
	}
	// What each live VM's guest asks for (a checkpoint of itself),
	// rate-limited, decided by its policy and recorded.
	var mgr *vm.Manager
	guestReqs := guestreq.New(guestreq.Config{Policies: pols, Audit: auditLog, Log: log.With("subsystem", "guestreq"),
		Checkpoint: func(ctx context.Context, name, snapshot, note string) error {
			_, err := mgr.Snapshot(ctx, name, vm.SnapshotParams{Name: snapshot, Note: note, Guest: true})
			return err
		}})
	// The host's GPUs, read from sysfs at each use. Creates are vetted
	// here; the drivers bind and release the devices.
	gpus := gpu.New(gpu.Config{})
	mgr = vm.New(vm.Config{
		Registry: reg, Images: images, Driver: drv, Logger: log, BootTimeout: cfg.BootTimeout, Vsock: vsock,
		QEMUImg:      workspace.QEMUImg(cfg.QEMUBinary),
		DiskTemplate: filepath.Join(cfg.StateDir, "disk-template.img"),
		Policies:     pols,
		OnEvent:      rec.Lifecycle(pols, images.ManifestBytes),
		// A name deleted is free for a new VM, which must not inherit
		// the old one's tokens.
		OnRemoved: func(name string) {
			if err := tokens.RevokeVM(name); err != nil {
				log.Error("tokens of a deleted vm not revoked", "vm", name, "err", err)
			}
		},
		CheckGPUs: func(want []string, held map[string][]string) error {
			_, err := gpus.Check(want, held)
			return err
		},
		AgentLive: func(live context.Context, v vm.Live) {
			name, session := v.Record.Name, v.Record.Session
			recordings.Go(func() { _ = activity.Run(live, v.Link, auditLog, name, session, log) })
			recordings.Go(func() { _ = eg.Serve(live, v.Link, egress.VM{Name: name, Session: session, Policy: v.Policy}) })
			recordings.Go(func() {
				_ = guestReqs.Serve(live, v.Link, guestreq.VM{Name: name, Session: session, Policy: v.Policy})
			})
		},
	})
	go faults.run(ctx, mgr)
	// VMs created with a time to live are ended when it is up.
	go mgr.ReapExpired(ctx)
	if err := mgr.Reconcile(ctx); err != nil {
		log.Error("reconcile", "err", err)
	}
	defer mgr.Close()

	l, err := listen(cfg.Socket, log)
	if err != nil {
		return err
	}
	b := &builder{cfg: cfg, images: images, log: log}
	var fleetFence *fence.Fence
	var guard func(procedure, vm string) error
	if cfg.Fleet != nil {
		fleetFence = newFence(ctx, cfg.Fleet, cfg.StateDir, mgr, log)
		guard = fleetFence.Guard
	}
	h := api.Handler(api.Config{
		Manager: mgr,
		Images:  images,
		Build:   b.build,
		Logger:  log,
		// Every call is authenticated and decided by policy.
		Policies:  pols,
		Tokens:    tokens,
		DaemonUID: uint32(os.Getuid()),
		Recorder:  rec,
		GPUs:      gpus,
		AuditDir:  filepath.Join(cfg.StateDir, "audit"),
		Fence:     guard,
		Info: func() api.Info {
			return api.Info{Version: Version, Accelerator: acc.Name, StateDir: cfg.StateDir, Vsock: vsock}
		},
	})
	systemd.Ready(status(mgr))
	log.Info("carreld serving", "socket", l.Addr().String(), "version", Version)
	go systemd.Watchdog(ctx, func() bool { return mgr.Responsive(5 * time.Second) })
	go func() {
		t := time.NewTicker(5 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				systemd.Status(status(mgr))
			}
		}
	}()
	if cfg.Fleet != nil {
		go runFleet(ctx, cfg, fleetFence, h, auditLog, log)
	}
	if cfg.E2BListen != "" {
		if err := serveE2B(ctx, cfg, h, tokens, log); err != nil {
			return err
		}
	}
	err = api.Serve(ctx, l, h)
	systemd.Stopping()
	return err
}

// serveE2B serves the e2b API on cfg.E2BListen, as carreld's own API is
// served (HTTP/1.1 and cleartext HTTP/2: Connect's streams work on both,
// and the Python SDK speaks HTTP/1.1 to a plain-text URL). It calls carreld's API
// handler h over an in-process pipe whose calls carry no peer
// credentials: each is made with its own caller's key or sandbox token.
func serveE2B(ctx context.Context, cfg Config, h http.Handler, tokens *identity.Tokens, log *slog.Logger) error {
	l, err := net.Listen("tcp", cfg.E2BListen)
	if err != nil {
		return fmt.Errorf("e2b API: %w", err)
	}
	if ap, err := netip.ParseAddrPort(l.Addr().String()); err == nil && !ap.Addr().IsLoopback() {
		log.Warn("the e2b API listens beyond loopback in plain text: put TLS in front of it", "addr", l.Addr().String())
	}
	pipe := api.NewPipe()
	go func() { _ = api.Serve(ctx, pipe, h) }()
	eh := e2b.Handler(e2b.Config{Dial: pipe.Dial, Tokens: tokens, MaxUpload: cfg.E2BMaxUpload, Logger: log.With("subsystem", "e2b")})
	go func() {
		if err := api.Serve(ctx, l, eh); err != nil && ctx.Err() == nil {
			log.Error("e2b API stopped", "err", err)
		}
	}()
	log.Info("e2b API serving", "addr", l.Addr().String())
	return nil
}

func status(m *vm.Manager) string {
	n := m.Running()
	if n == 1 {
		return "1 vm running"
	}
	return strconv.Itoa(n) + " vms running"
}

// lockStateDir takes an exclusive lock so that two carreld never manage the
// same VMs.
func lockStateDir(dir string) (func(), error) {
	f, err := os.OpenFile(filepath.Join(dir, "carreld.lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open state lock: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		return nil, fmt.Errorf("state dir %s is in use by another carreld: %w", dir, err)
	}
	return func() { f.Close() }, nil
}

// listen returns the socket-activated listener, or a fresh unix socket at
// path (mode 0660; a stale socket file is replaced, a live one is an error).
func listen(path string, log *slog.Logger) (net.Listener, error) {
	l, err := systemd.Listener()
	if err != nil {
		return nil, err
	}
	if l != nil {
		log.Info("using socket-activated listener", "addr", l.Addr().String())
		return l, nil
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("create socket dir: %w", err)
	}
	if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
		c.Close()
		return nil, fmt.Errorf("%s: another carreld is serving there", path)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("remove stale socket: %w", err)
	}
	l, err = net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o660); err != nil {
		l.Close()
		return nil, fmt.Errorf("chmod %s: %w", path, err)
	}
	return l, nil
}

// builder builds the development image into the store, one build at a time.
type builder struct {
	cfg    Config
	images *store.Store
	log    *slog.Logger
	mu     sync.Mutex
}

func (b *builder) build(ctx context.Context, spec *debian.Spec, tag string, noCache bool) (string, bool, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if spec == nil {
		return b.buildDev(ctx, tag)
	}
	sources, err := debian.HostSources()
	if err != nil {
		return "", false, err
	}
	key, err := debian.CacheKey(ctx, spec, b.cfg.AgentBinary, sources)
	if err != nil {
		return "", false, err
	}
	if dir := debian.Cached(b.cfg.CacheDir, key); dir != "" && !noCache {
		// Built before with the same inputs: import what that build made
		// (checked in full, as any import), whatever this store holds.
		out, err := b.images.Import(dir, tag)
		if err == nil {
			b.log.Info("image build cached", "digest", out.Digest, "tag", tag, "spec", spec.Name, "key", key)
			return out.Digest, true, nil
		}
		b.log.Warn("cached image not usable; building it again", "dir", dir, "err", err)
	}
	buildDir, err := debian.NewBuildDir(b.cfg.CacheDir)
	if err != nil {
		return "", false, err
	}
	defer os.RemoveAll(buildDir)
	built := filepath.Join(buildDir, "image")
	if _, err := debian.Build(ctx, debian.Options{
		Spec: spec, CacheDir: b.cfg.CacheDir, OutDir: built, AgentBinary: b.cfg.AgentBinary, Sources: sources, Logger: b.log,
	}); err != nil {
		return "", false, err
	}
	dir, err := debian.Keep(b.cfg.CacheDir, key, built)
	if err != nil {
		return "", false, err
	}
	digest, _, err := b.store(dir, tag)
	return digest, false, err
}

// buildDev builds the development image in a scratch directory of the
// state dir and stores it.
func (b *builder) buildDev(ctx context.Context, tag string) (string, bool, error) {
	tmp, err := os.MkdirTemp(b.cfg.StateDir, ".build-")
	if err != nil {
		return "", false, fmt.Errorf("build dir: %w", err)
	}
	defer os.RemoveAll(tmp)
	out := filepath.Join(tmp, "image")
	if _, err := devimage.Build(ctx, devimage.Options{
		CacheDir:    b.cfg.CacheDir,
		OutDir:      out,
		AgentBinary: b.cfg.AgentBinary,
		Logger:      b.log,
	}); err != nil {
		return "", false, err
	}
	return b.store(out, tag)
}

// store imports a built image directory: the same import as for an image
// built elsewhere, so every part is hashed again and the verity tree
// recomputed before it is stored.
func (b *builder) store(dir, tag string) (string, bool, error) {
	out, err := b.images.Import(dir, tag)
	if err != nil {
		return "", false, err
	}
	b.log.Info("image built", "digest", out.Digest, "tag", tag, "unchanged", out.Already)
	return out.Digest, false, nil
}

// importImages imports each declared image directory, checked in full as
// any import is. An image that fails is logged and left out: the VMs of
// the other images still run, and the store is unchanged by it.
func importImages(images *store.Store, dirs []string, log *slog.Logger) {
	for _, dir := range dirs {
		out, err := images.ImportNamed(dir)
		switch {
		case err != nil:
			log.Error("declared image not imported; fix or rebuild it, then restart carreld", "dir", dir, "err", err)
		case out.Already:
			log.Info("declared image already imported", "dir", dir, "image", out.Manifest.Name, "digest", out.Digest)
		default:
			log.Info("declared image imported", "dir", dir, "image", out.Manifest.Name, "digest", out.Digest)
		}
	}
}
