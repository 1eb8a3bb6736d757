// Package libvirt runs VMs as libvirt domains through libvirtd's RPC
// protocol (go-libvirt), so that operators see them in virsh and they get
// libvirt's confinement: QEMU as an unprivileged user, in its own cgroup
// and mount namespace, under its seccomp sandbox.
//
// Domains are transient (virDomainCreateXML): libvirt forgets one as soon
// as it stops, so nothing is left to undefine, and a host reboot leaves no
// stale definitions. They outlive carreld, and survive libvirtd restarts,
// so a restarted carreld finds them again by the UUID in the VM's record
// (Adopt). Each domain carries carrel's <metadata> element naming its VM
// directory; a domain without it, or for another directory, is never
// touched.
package libvirt

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	lv "github.com/digitalocean/go-libvirt"
	"libvirt.org/go/libvirtxml"

	"github.com/carrel-os/carrel/supervisor/accel"
	"github.com/carrel-os/carrel/supervisor/driver"
	"github.com/carrel-os/carrel/supervisor/gpu"
)

// Name is the driver's name in VM records.
const Name = "libvirt"

// DefaultURI is the libvirt connection carreld uses unless told otherwise.
const DefaultURI = "qemu:///system"

// systemRunDir is where the system libvirtd keeps QEMU pid files.
const systemRunDir = "/run/libvirt/qemu"

// File names inside a VM's directory.
const (
	agentSocketName   = "agent.sock"
	dataSocketName    = "data.sock"
	consoleSocketName = "console.sock"
	// markerName records the domain a Start is creating, before it is
	// created, so that Sweep can find it if carreld dies meanwhile.
	markerName = "libvirt-domain.json"
)

// maxSocketPath is sun_path's size less its terminating NUL.
const maxSocketPath = 107

// ErrUnsupported means the spec asks for something this driver cannot do.
var ErrUnsupported = errors.New("not supported by the libvirt driver")

// rpcTimeout bounds one call to libvirtd when the caller's context does
// not: go-libvirt sets no deadlines of its own.
const rpcTimeout = 30 * time.Second

// Config configures the driver.
type Config struct {
	// URI is the libvirt connection URI; default DefaultURI.
	URI string
	// Accelerator is accel.KVM or accel.TCG (see package accel): the
	// domain type is kvm or qemu accordingly.
	Accelerator string
	// RunDir is where libvirtd writes each QEMU's pid file: by default
	// /run/libvirt/qemu for qemu:///system and "" otherwise. With "" the
	// driver cannot see QEMU's process (a remote libvirtd, say): records
	// get no pid, and QEMU's seccomp sandbox goes unchecked.
	RunDir string
	Logger *slog.Logger
	// GPUs checks a VM's GPUs again at each start and gives the managed
	// VFIO hostdevs of their IOMMU groups; nil reads the host's /sys.
	GPUs *gpu.Host
	// QEMUImg is the qemu-img that makes the overlays of a snapshot;
	// default "qemu-img" from PATH.
	QEMUImg string
}

// Driver implements driver.Driver with libvirt.
type Driver struct {
	driver.SocketStreams
	cfg Config
	uri *url.URL
	log *slog.Logger

	mu   sync.Mutex
	conn *lv.Libvirt // nil until first use; redialled when lost

	// The lifecycle event subscription all Waits share (see events.go).
	subMu   sync.Mutex
	sub     *subscription
	subErr  error         // why the last registration failed
	pending chan struct{} // closed when the registration in flight ends
	// waiting, when set (by tests only, before any Wait), is called each
	// time a Wait has found its domain running with its watch in place:
	// from then on the domain's end reaches it as an event.
	waiting func(driver.Instance)
}

var _ driver.Driver = (*Driver)(nil)

// New returns a driver. It connects to libvirtd on first use; Ping checks
// that it can.
func New(cfg Config) (*Driver, error) {
	if cfg.URI == "" {
		cfg.URI = DefaultURI
	}
	u, err := url.Parse(cfg.URI)
	if err != nil {
		return nil, fmt.Errorf("libvirt uri %q: %w", cfg.URI, err)
	}
	if !strings.HasPrefix(u.Scheme, "qemu") {
		return nil, fmt.Errorf("libvirt uri %q: carrel needs a qemu:// connection", cfg.URI)
	}
	if cfg.RunDir == "" && u.Scheme == "qemu" && u.Host == "" && u.Path == "/system" {
		cfg.RunDir = systemRunDir
	}
	if cfg.Accelerator == "" {
		cfg.Accelerator = accel.TCG
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.QEMUImg == "" {
		cfg.QEMUImg = "qemu-img"
	}
	return &Driver{cfg: cfg, uri: u, log: cfg.Logger}, nil
}

// Name implements driver.Driver.
func (d *Driver) Name() string { return Name }

// Close drops the connection to libvirtd. Domains keep running.
func (d *Driver) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.conn == nil || !d.conn.IsConnected() {
		return nil
	}
	err := d.conn.Disconnect()
	d.conn = nil
	return err
}

// Ping connects to libvirtd and returns its version.
func (d *Driver) Ping(ctx context.Context) (string, error) {
	var v uint64
	err := d.do(ctx, "get libvirt version", func(c *lv.Libvirt) (err error) {
		v, err = c.ConnectGetLibVersion()
		return err
	})
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("%d.%d.%d", v/1000000, v/1000%1000, v%1000), nil
}

// client returns the connection to libvirtd, dialling it if there is none
// or it was lost (libvirtd restarted).
func (d *Driver) client(ctx context.Context) (*lv.Libvirt, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.conn != nil && d.conn.IsConnected() {
		return d.conn, nil
	}
	type result struct {
		l   *lv.Libvirt
		err error
	}
	ch := make(chan result, 1)
	go func() {
		l, err := lv.ConnectToURI(d.uri)
		ch <- result{l, err}
	}()
	select {
	case r := <-ch:
		if r.err != nil {
			return nil, fmt.Errorf("connect to libvirt at %s (is libvirtd running?): %w", d.cfg.URI, r.err)
		}
		d.conn = r.l
		return r.l, nil
	case <-ctx.Done():
		go func() {
			if r := <-ch; r.l != nil {
				r.l.Disconnect()
			}
		}()
		return nil, fmt.Errorf("connect to libvirt at %s: %w", d.cfg.URI, ctx.Err())
	}
}

// do runs fn against libvirtd, bounded by ctx and rpcTimeout. A call that
// runs past them is abandoned; it ends when libvirtd answers or the
// connection drops.
func (d *Driver) do(ctx context.Context, what string, fn func(*lv.Libvirt) error) error {
	ctx, cancel := context.WithTimeout(ctx, rpcTimeout)
	defer cancel()
	return d.doLong(ctx, what, fn)
}

// doLong is do bounded by ctx alone, for calls that move a VM's memory
// (a save or restore), which can outlast rpcTimeout.
func (d *Driver) doLong(ctx context.Context, what string, fn func(*lv.Libvirt) error) error {
	c, err := d.client(ctx)
	if err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	done := make(chan error, 1)
	go func() { done <- fn(c) }()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("%s: libvirtd did not answer: %w", what, ctx.Err())
	}
}

// layout is where a VM's files live.
type layout struct {
	dir, agent, data, console, marker string
}

func newLayout(dir string) (layout, error) {
	dir = filepath.Clean(dir)
	l := layout{
		dir:     dir,
		agent:   filepath.Join(dir, agentSocketName),
		data:    filepath.Join(dir, dataSocketName),
		console: filepath.Join(dir, consoleSocketName),
		marker:  filepath.Join(dir, markerName),
	}
	for _, p := range []string{l.agent, l.data, l.console} {
		if len(p) > maxSocketPath {
			return layout{}, fmt.Errorf("socket path %q is longer than %d bytes: use a shorter state dir", p, maxSocketPath)
		}
	}
	return l, nil
}

// marker is the content of markerName.
type marker struct {
	Domain string `json:"domain"`
	UUID   string `json:"uuid"`
}

func writeMarker(path string, m marker) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("write domain marker: %w", err)
	}
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("write domain marker: %w", err)
	}
	return nil
}

func (d *Driver) domainType() string {
	if d.cfg.Accelerator == accel.KVM {
		return "kvm"
	}
	return "qemu"
}

// Start implements driver.Lifecycle. The domain is created paused
// (VIR_DOMAIN_START_PAUSED), with its console and agent sockets already
// listening.
func (d *Driver) Start(ctx context.Context, spec driver.Spec) (driver.Instance, error) {
	// The GPUs go as managed hostdevs: libvirt binds them to vfio-pci
	// before QEMU starts and gives them back after. The host is checked
	// again here (IOMMU on, whole group assignable) so that a VM never
	// boots without the GPUs it was created with.
	var hostdevs []libvirtxml.DomainHostdev
	if len(spec.GPUs) > 0 {
		h := d.cfg.GPUs
		if h == nil {
			h = gpu.New(gpu.Config{})
		}
		var err error
		if hostdevs, err = h.Hostdevs(spec.GPUs); err != nil {
			return driver.Instance{}, fmt.Errorf("vm %q's gpus %s: %w", spec.Name, strings.Join(spec.GPUs, ", "), err)
		}
	}
	l, err := newLayout(spec.Dir)
	if err != nil {
		return driver.Instance{}, err
	}
	steps := newStepTimer()
	name := DomainName(spec.Name)
	uid, user, err := d.qemuUser(ctx)
	if err != nil {
		return driver.Instance{}, err
	}
	steps.done("capabilities")
	readOnly := []string{spec.Kernel, spec.Initrd}
	var readWrite []string
	for _, disk := range spec.Disks {
		readOnly = append(readOnly, disk.Layers...)
		if disk.Backing != "" {
			readOnly = append(readOnly, disk.Backing)
		}
		if disk.ReadOnly {
			readOnly = append(readOnly, disk.Path)
		} else {
			readWrite = append(readWrite, disk.Path)
		}
	}
	for _, p := range readOnly {
		changed, err := grantRead(p, uid)
		if len(changed) > 0 {
			d.log.Info("granted qemu's user read access through acls", "uid", uid, "paths", changed)
		}
		if err != nil {
			return driver.Instance{}, fmt.Errorf("let qemu (uid %d) read %s: %w", uid, p, err)
		}
	}
	for _, p := range readWrite {
		changed, err := grantReadWrite(p, uid)
		if len(changed) > 0 {
			d.log.Info("granted qemu's user read-write access through acls", "uid", uid, "paths", changed)
		}
		if err != nil {
			return driver.Instance{}, fmt.Errorf("let qemu (uid %d) write %s: %w", uid, p, err)
		}
	}
	steps.done("acls")
	// libvirtd binds the sockets itself; stale ones from a domain that
	// died with libvirtd would be in its way.
	for _, p := range []string{l.agent, l.data, l.console} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return driver.Instance{}, fmt.Errorf("remove stale socket: %w", err)
		}
	}
	uuid, err := newUUID()
	if err != nil {
		return driver.Instance{}, err
	}
	if err := writeMarker(l.marker, marker{Domain: name, UUID: uuid}); err != nil {
		return driver.Instance{}, err
	}
	cfg := domainConfig{
		Spec: spec, Name: name, UUID: uuid, Accelerator: d.cfg.Accelerator, User: user,
		AgentSocket: l.agent, DataSocket: l.data, ConsoleSocket: l.console, Hostdevs: hostdevs,
	}
	inst := driver.Instance{
		Driver:        Name,
		AgentSocket:   l.agent,
		DataSocket:    l.data,
		ConsoleSocket: l.console,
		Accelerator:   d.cfg.Accelerator,
		Domain:        name,
		DomainUUID:    uuid,
	}
	d.log.Debug("creating domain", "vm", spec.Name, "domain", name, "uuid", uuid, "restore", spec.Incoming != nil)
	var dom lv.Domain
	data := !spec.NoDataPort
	if spec.Incoming != nil {
		// The saved domain's ports, whatever the spec says.
		dom, data, err = d.restore(ctx, cfg, l)
	} else {
		var x string
		x, err = domainXML(cfg)
		if err == nil {
			err = d.do(ctx, "create domain "+name, func(c *lv.Libvirt) (err error) {
				dom, err = c.DomainCreateXML(x, lv.DomainStartPaused)
				return err
			})
		}
	}
	if !data {
		inst.DataSocket = ""
	}
	fail := func(err error) (driver.Instance, error) {
		// Also when the create itself failed: it may have reached libvirtd
		// after this call gave up on it.
		kctx, cancel := context.WithTimeout(context.Background(), rpcTimeout)
		defer cancel()
		return driver.Instance{}, errors.Join(err, d.Kill(kctx, inst))
	}
	if err != nil {
		return fail(err)
	}
	steps.done("create")
	// The memory limit is in place before the guest runs (see memoryLimit).
	err = d.do(ctx, "limit memory of domain "+name, func(c *lv.Libvirt) error {
		return c.DomainSetMemoryParameters(dom, []lv.TypedParam{memoryLimit(spec, d.cfg.Accelerator)}, uint32(lv.DomainAffectLive))
	})
	if err != nil {
		return fail(err)
	}
	steps.done("memory limit")
	if spec.CID != 0 {
		var live string
		err := d.do(ctx, "read domain "+name, func(c *lv.Libvirt) (err error) {
			live, err = c.DomainGetXMLDesc(dom, 0)
			return err
		})
		if err == nil {
			inst.CID, err = liveCID(live)
		}
		if err == nil && inst.CID == 0 {
			err = fmt.Errorf("domain %s got no vsock cid", name)
		}
		if err != nil {
			return fail(err)
		}
	}
	if d.cfg.RunDir != "" {
		pid, err := qemuPID(d.cfg.RunDir, name)
		if err == nil {
			err = checkSandbox(pid)
		}
		if err != nil {
			return fail(err)
		}
		inst.PID = pid
	}
	steps.done("checks")
	d.log.Debug("domain created, paused", append([]any{"vm", spec.Name, "domain", name}, steps.attrs()...)...)
	return inst, nil
}

// qemuUser returns the uid QEMU runs as, and its DAC label "+uid:+gid",
// from libvirt's host capabilities.
func (d *Driver) qemuUser(ctx context.Context) (uid int, label string, err error) {
	var capsXML string
	err = d.do(ctx, "read host capabilities", func(c *lv.Libvirt) (err error) {
		capsXML, err = c.ConnectGetCapabilities()
		return err
	})
	if err != nil {
		return 0, "", err
	}
	uid, _, label, err = dacUser(capsXML, d.domainType())
	return uid, label, err
}

// stepTimer times the steps of a domain's start, for the debug log: where
// the time between carreld's request and a paused domain goes.
type stepTimer struct {
	last  time.Time
	steps []any
}

func newStepTimer() *stepTimer { return &stepTimer{last: time.Now()} }

func (t *stepTimer) done(step string) {
	now := time.Now()
	t.steps = append(t.steps, step, now.Sub(t.last).Round(time.Microsecond))
	t.last = now
}

func (t *stepTimer) attrs() []any { return t.steps }

func newUUID() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("domain uuid: %w", err)
	}
	b[6] = b[6]&0x0f | 0x40 // version 4
	b[8] = b[8]&0x3f | 0x80 // RFC 4122 variant
	h := hex.EncodeToString(b[:])
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:], nil
}

func parseUUID(s string) (lv.UUID, error) {
	var u lv.UUID
	b, err := hex.DecodeString(strings.ReplaceAll(s, "-", ""))
	if err != nil || len(b) != len(u) {
		return u, fmt.Errorf("bad domain uuid %q", s)
	}
	copy(u[:], b)
	return u, nil
}

// domain finds the domain with uuid and checks that it is carrel's domain
// name for the VM directory dir. A domain that is gone, or is not that,
// is driver.ErrNotRunning: carreld has nothing running there.
func (d *Driver) domain(ctx context.Context, uuid, name, dir string) (lv.Domain, error) {
	u, err := parseUUID(uuid)
	if err != nil {
		return lv.Domain{}, err
	}
	var dom lv.Domain
	var raw string
	err = d.do(ctx, "look up domain "+name, func(c *lv.Libvirt) (err error) {
		if dom, err = c.DomainLookupByUUID(u); err != nil {
			return err
		}
		raw, err = c.DomainGetMetadata(dom, int32(lv.DomainMetadataElement), lv.OptString{MetadataNS}, lv.DomainAffectCurrent)
		return err
	})
	switch {
	case lv.IsNotFound(err):
		return lv.Domain{}, fmt.Errorf("%w: domain %s is gone", driver.ErrNotRunning, name)
	case isCode(err, lv.ErrNoDomainMetadata):
		return lv.Domain{}, fmt.Errorf("%w: domain %s (%s) is not carrel's", driver.ErrNotRunning, dom.Name, uuid)
	case err != nil:
		return lv.Domain{}, err
	}
	m, err := parseMetadata(raw)
	if err != nil {
		return lv.Domain{}, err
	}
	if dom.Name != name || filepath.Clean(m.Dir) != filepath.Clean(dir) {
		return lv.Domain{}, fmt.Errorf("%w: domain %s (%s) belongs to %s, not to %s in %s", driver.ErrNotRunning, dom.Name, uuid, m.Dir, name, dir)
	}
	return dom, nil
}

func isCode(err error, code lv.ErrorNumber) bool {
	var e lv.Error
	return errors.As(err, &e) && e.Code == uint32(code)
}

// instDomain is domain for a recorded instance; its sockets lie in the VM's
// directory.
func (d *Driver) instDomain(ctx context.Context, inst driver.Instance) (lv.Domain, error) {
	if inst.DomainUUID == "" {
		return lv.Domain{}, fmt.Errorf("%w: the record names no libvirt domain", driver.ErrNotRunning)
	}
	return d.domain(ctx, inst.DomainUUID, inst.Domain, filepath.Dir(inst.AgentSocket))
}

// Resume implements driver.Lifecycle.
func (d *Driver) Resume(ctx context.Context, inst driver.Instance) error {
	dom, err := d.instDomain(ctx, inst)
	if err != nil {
		return err
	}
	return d.do(ctx, "resume domain "+dom.Name, func(c *lv.Libvirt) error { return c.DomainResume(dom) })
}

// Pause implements driver.Lifecycle.
func (d *Driver) Pause(ctx context.Context, inst driver.Instance) error {
	dom, err := d.instDomain(ctx, inst)
	if err != nil {
		return err
	}
	return d.do(ctx, "suspend domain "+dom.Name, func(c *lv.Libvirt) error { return c.DomainSuspend(dom) })
}

// Adopt implements driver.Lifecycle: the domain must still exist, be
// carrel's for this VM, and be active.
func (d *Driver) Adopt(ctx context.Context, inst driver.Instance) (paused bool, err error) {
	dom, state, err := d.activeDomain(ctx, inst)
	if err != nil {
		return false, err
	}
	d.log.Debug("adopted domain", "domain", dom.Name, "state", state)
	return state == lv.DomainPaused, nil
}

// activeDomain is instDomain for a domain that is active (running or
// paused); one that is not is driver.ErrNotRunning.
func (d *Driver) activeDomain(ctx context.Context, inst driver.Instance) (lv.Domain, lv.DomainState, error) {
	dom, err := d.instDomain(ctx, inst)
	if err != nil {
		return dom, 0, err
	}
	var state int32
	err = d.do(ctx, "get state of domain "+dom.Name, func(c *lv.Libvirt) (err error) {
		state, _, err = c.DomainGetState(dom, 0)
		return err
	})
	if lv.IsNotFound(err) {
		return dom, 0, fmt.Errorf("%w: domain %s is gone", driver.ErrNotRunning, dom.Name)
	}
	if err != nil {
		return dom, 0, err
	}
	switch st := lv.DomainState(state); st {
	case lv.DomainShutoff, lv.DomainCrashed, lv.DomainNostate:
		return dom, st, fmt.Errorf("%w: domain %s is in state %d", driver.ErrNotRunning, dom.Name, st)
	default:
		return dom, st, nil
	}
}

// Wait implements driver.Lifecycle, on libvirt's lifecycle events. When
// the connection to libvirtd drops (libvirtd restarted), it reconnects
// and keeps waiting: the domain outlives libvirtd.
func (d *Driver) Wait(ctx context.Context, inst driver.Instance) error {
	u, err := parseUUID(inst.DomainUUID)
	if err != nil {
		return err
	}
	for {
		ended, err := d.waitOnce(ctx, inst, u)
		if ended || ctx.Err() != nil {
			return ctx.Err()
		}
		d.log.Debug("waiting on domain again", "domain", inst.Domain, "err", err)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// waitOnce reports whether the domain has ended; when it returns false
// without ctx ending, the wait broke (err says why) and may be retried.
func (d *Driver) waitOnce(ctx context.Context, inst driver.Instance, u lv.UUID) (bool, error) {
	s, err := d.subscription(ctx)
	if err != nil {
		return false, err
	}
	ended, stop := s.watch(u)
	defer stop()
	// Watched first, then checked: an end in between is not missed.
	if _, _, err := d.activeDomain(ctx, inst); errors.Is(err, driver.ErrNotRunning) {
		return true, nil
	} else if err != nil {
		return false, err
	}
	if d.waiting != nil {
		d.waiting(inst)
	}
	select {
	case <-ended:
		return true, nil
	case <-s.done:
		return false, errors.New("libvirt event stream closed")
	case <-ctx.Done():
		return false, ctx.Err()
	}
}

// Kill implements driver.Lifecycle: destroy (SIGTERM, then SIGKILL), and
// undefine should someone have made the domain persistent meanwhile, so
// that its name is free for the next start.
func (d *Driver) Kill(ctx context.Context, inst driver.Instance) error {
	dom, err := d.instDomain(ctx, inst)
	if errors.Is(err, driver.ErrNotRunning) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("kill vm: %w", err)
	}
	err = d.do(ctx, "destroy domain "+dom.Name, func(c *lv.Libvirt) error {
		return c.DomainDestroyFlags(dom, lv.DomainDestroyDefault)
	})
	if err != nil && !lv.IsNotFound(err) && !isCode(err, lv.ErrOperationInvalid) {
		return err
	}
	var persistent int32
	err = d.do(ctx, "check domain "+dom.Name, func(c *lv.Libvirt) (err error) {
		persistent, err = c.DomainIsPersistent(dom)
		return err
	})
	if lv.IsNotFound(err) || (err == nil && persistent == 0) {
		return nil
	}
	if err != nil {
		return err
	}
	d.log.Warn("undefining domain that was made persistent", "domain", dom.Name)
	err = d.do(ctx, "undefine domain "+dom.Name, func(c *lv.Libvirt) error { return c.DomainUndefineFlags(dom, 0) })
	if lv.IsNotFound(err) {
		return nil
	}
	return err
}

// Sweep implements driver.Lifecycle: it destroys the domain whose creation
// the marker in dir records, if it exists and is carrel's for dir. Without
// a marker there is nothing to do and libvirtd is not asked.
func (d *Driver) Sweep(ctx context.Context, dir string) error {
	l, err := newLayout(dir)
	if err != nil {
		return err
	}
	b, err := os.ReadFile(l.marker)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read domain marker: %w", err)
	}
	var m marker
	if err := json.Unmarshal(b, &m); err != nil {
		return fmt.Errorf("domain marker %s: %w", l.marker, err)
	}
	inst := driver.Instance{Driver: Name, Domain: m.Domain, DomainUUID: m.UUID, AgentSocket: l.agent, DataSocket: l.data, ConsoleSocket: l.console}
	if _, err := d.instDomain(ctx, inst); errors.Is(err, driver.ErrNotRunning) {
		return nil
	} else if err != nil {
		return err
	}
	d.log.Warn("destroying domain left by an interrupted start", "domain", m.Domain, "dir", dir)
	return d.Kill(ctx, inst)
}
