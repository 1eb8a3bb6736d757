// Package qemu runs VMs by starting qemu-system-x86_64 directly and driving
// it over QMP with go-qemu. It needs nothing but QEMU on the host.
//
// QEMU runs in a session of its own, so VMs outlive carreld: a restarted
// carreld finds them again from the pid, its start time and the QMP socket
// (Adopt).
package qemu

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/digitalocean/go-qemu/qmp"
	"github.com/digitalocean/go-qemu/qmp/raw"

	"github.com/carrel-os/carrel/supervisor/driver"
	"github.com/carrel-os/carrel/supervisor/gpu"
)

// Name is the driver's name in VM records.
const Name = "qemu"

// Config configures the driver.
type Config struct {
	// Binary is the QEMU program; default "qemu-system-x86_64".
	Binary string
	// Machine is MachineMicroVM, MachineQ35, or "" for the best one for
	// the accelerator (see DefaultMachine).
	Machine string
	// Accelerator is "kvm" or "tcg" (see package accel).
	Accelerator string
	Logger      *slog.Logger
	// NewMonitor opens a QMP monitor; tests replace it with qmptest.
	NewMonitor func(socket string) (qmp.Monitor, error)
	// Cgroups puts each QEMU in a cgroup v2 group of its own with memory,
	// CPU and process limits, where the host allows it (see cgroup.go).
	Cgroups bool
	// GPUs vets and binds the GPUs VMs are given (vfio.go); nil means the
	// host's own sysfs.
	GPUs *gpu.Host
	// Jail runs each QEMU as an unprivileged user of its own, in a jail
	// (jail.go); nil runs QEMU as carreld's user. It needs root.
	Jail *Jail
	// QEMUImg makes the overlays a jailed QEMU's snapshots move its disks
	// to; default "qemu-img".
	QEMUImg string
}

// Driver implements driver.Driver with QEMU.
type Driver struct {
	driver.SocketStreams
	cfg  Config
	cg   *hostCgroup // nil: no cgroup limits
	uids uids
}

var _ driver.Driver = (*Driver)(nil)

// New returns a driver. It does not check that QEMU is installed; Start
// reports that.
func New(cfg Config) *Driver {
	if cfg.Binary == "" {
		cfg.Binary = "qemu-system-x86_64"
	}
	if cfg.Machine == "" || cfg.Machine == MachineAuto {
		cfg.Machine = DefaultMachine(cfg.Accelerator)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.GPUs == nil {
		cfg.GPUs = gpu.New(gpu.Config{})
	}
	if cfg.QEMUImg == "" {
		cfg.QEMUImg = "qemu-img"
	}
	if j := cfg.Jail; j != nil {
		if j.UIDBase == 0 {
			j.UIDBase = DefaultUIDBase
		}
		if j.UIDs == 0 {
			j.UIDs = DefaultUIDs
		}
	}
	if cfg.NewMonitor == nil {
		cfg.NewMonitor = func(socket string) (qmp.Monitor, error) {
			return qmp.NewSocketMonitor("unix", socket, 5*time.Second)
		}
	}
	d := &Driver{cfg: cfg}
	if cfg.Cgroups {
		self, err := selfCgroup()
		if err == nil {
			d.cg, err = openHostCgroup("/sys/fs/cgroup", self, statfsIsCgroup2)
		}
		if err != nil {
			cfg.Logger.Info("no cgroup v2 limits for qemu: the vms are limited by qemu's -m and -smp alone", "reason", err)
		} else {
			cfg.Logger.Info("each qemu gets a cgroup v2 group with memory, cpu and pids limits", "parent", d.cg.base)
		}
	}
	return d
}

// DefaultMachine picks the machine type for an accelerator. Under KVM,
// microvm boots fastest (the guest gets kvm-clock). Under TCG it is not
// safe: microvm has no HPET and no ACPI PM timer, so when the kernel's
// TSC calibration against the PIT fails, which happened in 1 of 12 boots
// here, the guest hangs before userspace. q35 has both timers and booted
// 12 of 12, about 0.25 s slower (5.5 s against 5.25 s median).
func DefaultMachine(accelerator string) string {
	if accelerator == "kvm" {
		return MachineMicroVM
	}
	return MachineQ35
}

// Machine returns the machine type VMs get.
func (d *Driver) Machine() string { return d.cfg.Machine }

// Name implements driver.Driver.
func (d *Driver) Name() string { return Name }

// Start implements driver.Lifecycle.
func (d *Driver) Start(ctx context.Context, spec driver.Spec) (_ driver.Instance, err error) {
	l, err := newLayout(spec.Dir)
	if err != nil {
		return driver.Instance{}, err
	}
	// GPUs first, so that a host that cannot hand them over fails the
	// start before anything runs; from here on a failure gives them back.
	gpus, err := d.bindGPUs(spec, l)
	if err != nil {
		return driver.Instance{}, err
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, d.releaseGPUs(gpu.Strings(gpus.moved), l.vfio))
		}
	}()
	sockets := []string{l.qmp, l.agent, l.console, l.data}
	data := l.data
	if spec.NoDataPort {
		sockets, data = sockets[:3], ""
	}
	files, err := listenAll(sockets...)
	if err != nil {
		return driver.Instance{}, err
	}
	if spec.Incoming != nil {
		// QEMU gets its own descriptor, closed below with the others.
		in, err := os.Open("/proc/self/fd/" + strconv.Itoa(int(spec.Incoming.Fd())))
		if err != nil {
			closeAll(files)
			return driver.Instance{}, fmt.Errorf("open the saved state: %w", err)
		}
		files = append(files, in)
	}
	logf, err := os.OpenFile(l.log, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		closeAll(files)
		return driver.Instance{}, fmt.Errorf("create qemu log: %w", err)
	}
	argv := append(args(spec, gpus.machine(d.cfg.Machine), d.cfg.Accelerator, l), gpus.args...)
	// Not CommandContext: the VM must outlive this request (and carreld).
	var cmd *exec.Cmd
	var uid uint32
	if d.cfg.Jail != nil {
		var release func()
		uid, release, err = d.uids.reserve(d.cfg.Jail)
		if err == nil {
			defer release()
			// The jail writes the pid file, with the start time.
			cmd, err = d.jailed(spec, l, uid, gpus, argv, len(files))
		}
		if err != nil {
			closeAll(files)
			logf.Close()
			return driver.Instance{}, err
		}
	} else {
		// Written by QEMU early in its start, so that a carreld that
		// dies before Start returns can still find and end it (Sweep).
		cmd = exec.Command(d.cfg.Binary, append(argv, "-pidfile", l.pidfile)...)
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Dir = spec.Dir
	cmd.ExtraFiles = files
	// Its own session: no signal aimed at carreld's group reaches QEMU.
	cmd.SysProcAttr.Setsid = true
	cgroupPath := ""
	if d.cg != nil {
		cg, path, err := d.cg.create(vmCgroupName(spec.Dir), spec.MemoryBytes, spec.CPUs, d.cfg.Accelerator)
		if err != nil {
			closeAll(files)
			logf.Close()
			return driver.Instance{}, fmt.Errorf("qemu's cgroup: %w", err)
		}
		defer cg.Close()
		cmd.SysProcAttr.UseCgroupFD, cmd.SysProcAttr.CgroupFD = true, int(cg.Fd())
		cgroupPath = path
	}
	d.cfg.Logger.Debug("starting qemu", "vm", spec.Name, "argv", strings.Join(argv, " "))
	err = cmd.Start()
	// QEMU holds its own copies now. Dropping ours means a QEMU that dies
	// resets every connection to its sockets instead of leaving it hanging.
	closeAll(files)
	logf.Close()
	if err != nil {
		removeSockets(l)
		_ = removeCgroup(cgroupPath)
		return driver.Instance{}, fmt.Errorf("start %s: %w", d.cfg.Binary, err)
	}
	exited := make(chan struct{})
	go func() {
		// carreld started QEMU, so carreld reaps it. After a carreld
		// restart, QEMU belongs to init and Wait uses a pidfd instead.
		_ = cmd.Wait()
		close(exited)
	}()
	fail := func(err error) (driver.Instance, error) {
		_ = cmd.Process.Kill()
		<-exited
		removeSockets(l)
		_ = removeCgroup(cgroupPath)
		return driver.Instance{}, fmt.Errorf("%w: %s", err, tailFile(l.log, 10))
	}
	// A bad argument, a missing kernel or a busy device makes QEMU exit
	// before it answers QMP.
	if err := d.awaitInit(ctx, l.qmp, exited); err != nil {
		return fail(err)
	}
	if spec.Incoming != nil {
		if err := d.awaitIncoming(ctx, l.qmp, exited); err != nil {
			return fail(err)
		}
	}
	start, zombie, err := procStartTime(cmd.Process.Pid)
	if err != nil || zombie {
		return fail(errors.New("qemu exited right after start"))
	}
	return driver.Instance{
		Driver:        Name,
		PID:           cmd.Process.Pid,
		StartTime:     start,
		QMPSocket:     l.qmp,
		AgentSocket:   l.agent,
		DataSocket:    data,
		ConsoleSocket: l.console,
		CID:           spec.CID,
		Accelerator:   d.cfg.Accelerator,
		Cgroup:        cgroupPath,
		VFIO:          gpu.Strings(gpus.moved),
		UID:           uid,
	}, nil
}

// listenAll creates a listening unix socket at each path and returns them
// as files to hand to QEMU.
func listenAll(paths ...string) ([]*os.File, error) {
	var files []*os.File
	for _, p := range paths {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			closeAll(files)
			return nil, fmt.Errorf("remove stale socket: %w", err)
		}
		ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: p, Net: "unix"})
		if err != nil {
			closeAll(files)
			return nil, fmt.Errorf("listen %s: %w", p, err)
		}
		ln.SetUnlinkOnClose(false)
		f, err := ln.File()
		ln.Close()
		if err != nil {
			closeAll(files)
			return nil, fmt.Errorf("listener file %s: %w", p, err)
		}
		files = append(files, f)
	}
	return files, nil
}

func closeAll(files []*os.File) {
	for _, f := range files {
		f.Close()
	}
}

func removeSockets(l layout) {
	for _, p := range []string{l.qmp, l.agent, l.data, l.console} {
		_ = os.Remove(p)
	}
}

// awaitInit waits until QEMU answers a QMP command, racing its exit and
// ctx. QEMU greets on QMP before it has loaded the kernel, so the greeting
// alone proves nothing; a command answered from the main loop does.
func (d *Driver) awaitInit(ctx context.Context, socket string, exited <-chan struct{}) error {
	done := make(chan error, 1)
	go func() {
		done <- d.monitor(ctx, socket, func(m *raw.Monitor) error {
			_, err := m.QueryStatus()
			return err
		})
	}()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("qemu did not start: %w", err)
		}
		return nil
	case <-exited:
		return errors.New("qemu exited during start")
	case <-ctx.Done():
		return fmt.Errorf("qemu did not start: %w", ctx.Err())
	}
}

// tailFile returns the last n lines of a small log file.
func tailFile(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	if len(b) > 64<<10 {
		b = b[len(b)-64<<10:]
	}
	return strings.TrimSpace(lastLines(string(b), n))
}

// qmpTimeout bounds one QMP exchange when the caller's context does not.
const qmpTimeout = 10 * time.Second

// rawMonitor runs fn on a fresh QMP connection, bounded by ctx and
// qmpTimeout. QEMU serves one QMP client at a time, so connections are
// short-lived. go-qemu sets no deadlines itself and the listening socket is
// ours, so a connect always succeeds: a QEMU that is stuck, or whose QMP
// another client holds, would block forever. The exchange runs aside and
// is abandoned when the deadline passes; it ends when QEMU does.
func (d *Driver) rawMonitor(ctx context.Context, socket string, fn func(qmp.Monitor) error) error {
	ctx, cancel := context.WithTimeout(ctx, qmpTimeout)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		mon, err := d.cfg.NewMonitor(socket)
		if err != nil {
			done <- fmt.Errorf("qmp %s: %w", socket, err)
			return
		}
		if err := mon.Connect(); err != nil {
			done <- fmt.Errorf("qmp connect %s: %w", socket, err)
			return
		}
		defer mon.Disconnect()
		done <- fn(mon)
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("qmp %s: no answer: %w", socket, ctx.Err())
	}
}

// monitor is rawMonitor with go-qemu's typed commands.
func (d *Driver) monitor(ctx context.Context, socket string, fn func(*raw.Monitor) error) error {
	return d.rawMonitor(ctx, socket, func(mon qmp.Monitor) error { return fn(raw.NewMonitor(mon)) })
}

// Resume implements driver.Lifecycle.
func (d *Driver) Resume(ctx context.Context, inst driver.Instance) error {
	return d.monitor(ctx, inst.QMPSocket, func(m *raw.Monitor) error {
		if err := m.Cont(); err != nil {
			return fmt.Errorf("qmp cont: %w", err)
		}
		return nil
	})
}

// Pause implements driver.Lifecycle.
func (d *Driver) Pause(ctx context.Context, inst driver.Instance) error {
	return d.monitor(ctx, inst.QMPSocket, func(m *raw.Monitor) error {
		if err := m.Stop(); err != nil {
			return fmt.Errorf("qmp stop: %w", err)
		}
		return nil
	})
}

// Adopt implements driver.Lifecycle.
func (d *Driver) Adopt(ctx context.Context, inst driver.Instance) (paused bool, err error) {
	if !alive(inst.PID, inst.StartTime) {
		return false, driver.ErrNotRunning
	}
	err = d.monitor(ctx, inst.QMPSocket, func(m *raw.Monitor) error {
		st, err := m.QueryStatus()
		if err != nil {
			return fmt.Errorf("qmp query-status: %w", err)
		}
		d.cfg.Logger.Debug("adopted qemu", "pid", inst.PID, "status", st.Status.String(), "running", st.Running)
		paused = !st.Running
		return nil
	})
	if err != nil && !alive(inst.PID, inst.StartTime) {
		return false, driver.ErrNotRunning
	}
	return paused, err
}

// Wait implements driver.Lifecycle.
func (d *Driver) Wait(ctx context.Context, inst driver.Instance) error {
	return waitExit(ctx, inst.PID, inst.StartTime)
}

// Kill implements driver.Lifecycle.
func (d *Driver) Kill(ctx context.Context, inst driver.Instance) (err error) {
	defer func() {
		if err == nil {
			err = errors.Join(removeCgroup(inst.Cgroup), d.releaseGPUs(inst.VFIO, filepath.Join(filepath.Dir(inst.QMPSocket), vfioFileName)))
		}
	}()
	if !alive(inst.PID, inst.StartTime) {
		return nil
	}
	// Ask QEMU to quit first, briefly: it exits cleanly. Then SIGKILL.
	qctx, qcancel := context.WithTimeout(ctx, 2*time.Second)
	qerr := d.monitor(qctx, inst.QMPSocket, func(m *raw.Monitor) error { return m.Quit() })
	qcancel()
	wctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if qerr == nil && waitExit(wctx, inst.PID, inst.StartTime) == nil {
		return nil
	}
	if err := kill(inst.PID, inst.StartTime, 10*time.Second); err != nil {
		return fmt.Errorf("kill qemu %d: %w", inst.PID, err)
	}
	return nil
}

// Sweep implements driver.Lifecycle. It also gives back the devices a
// start moved to vfio-pci, or was about to, before a carreld died.
func (d *Driver) Sweep(ctx context.Context, dir string) error {
	l, err := newLayout(dir)
	if err != nil {
		return err
	}
	moved, err := readMoved(l.vfio)
	if err != nil {
		return err
	}
	release := func() error {
		if len(moved) > 0 {
			d.cfg.Logger.Warn("giving back gpus an interrupted start bound to vfio-pci", "dir", dir, "devices", moved)
		}
		return d.releaseGPUs(moved, l.vfio)
	}
	b, err := os.ReadFile(l.pidfile)
	if errors.Is(err, os.ErrNotExist) {
		return release()
	}
	if err != nil {
		return fmt.Errorf("read qemu pid file: %w", err)
	}
	// QEMU's own pid file holds its pid; the jail's, its pid and start
	// time.
	f := strings.Fields(string(b))
	pid, err := 0, errors.New("empty")
	if len(f) == 1 || len(f) == 2 {
		pid, err = strconv.Atoi(f[0])
	}
	if err != nil || pid <= 0 {
		return fmt.Errorf("qemu pid file %s holds %q", l.pidfile, b)
	}
	// Only a QEMU started for this directory is ours to kill: the pid may
	// have been reused since.
	start, zombie, err := procStartTime(pid)
	if err != nil || zombie {
		return release()
	}
	if len(f) == 2 {
		if f[1] != strconv.FormatUint(start, 10) {
			return release()
		}
	} else if cmdline, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline"); err != nil || !strings.Contains(string(cmdline), "\x00"+l.pidfile+"\x00") {
		return release()
	}
	d.cfg.Logger.Warn("killing qemu left by an interrupted start", "pid", pid, "dir", dir)
	inst := driver.Instance{PID: pid, StartTime: start, QMPSocket: l.qmp, VFIO: moved}
	if d.cg != nil {
		inst.Cgroup = filepath.Join(d.cg.base, vmCgroupName(dir))
	}
	return d.Kill(ctx, inst) // gives moved back once QEMU is gone
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
