//go:build linux

// Command carrel-agent is the in-guest agent. In carrel's images it is the
// initramfs's PID 1 (/init): it sets the system up, mounts the image's
// verified root and switches to it, then serves the agent API to the host
// over vsock or virtio-serial. In an image that brings its own init
// (systemd), it runs as a service with --system: the init system does PID
// 1's work, and the agent serves, runs the egress proxies, gives each
// command a cgroup in the subtree the service was delegated, and powers
// off through the init system. In an image whose initrd is systemd's (the
// NixOS guest), --mount-state sets the VM's writable layer up there. Run as
// any other pid without --system (on a development host) it only serves,
// and can listen on a unix socket.
//
// Every command it starts runs with no_new_privs, and, once the host has
// set a sandbox (SetSandbox), inside a Landlock domain where the kernel has
// Landlock; the file service then keeps to the sandbox's roots. The agent
// itself is never confined. As PID 1 it starts each command in a cgroup of
// its own; as root it watches what commands do in /workspace (package
// activity) for the host's Activity call.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	osexec "os/exec"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/guest-agent/activity"
	"github.com/carrel-os/carrel/guest-agent/cgroups"
	"github.com/carrel-os/carrel/guest-agent/egress"
	"github.com/carrel-os/carrel/guest-agent/exec"
	"github.com/carrel-os/carrel/guest-agent/files"
	"github.com/carrel-os/carrel/guest-agent/initsys"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/guest-agent/reaper"
	"github.com/carrel-os/carrel/guest-agent/sandbox"
	"github.com/carrel-os/carrel/guest-agent/server"
	"github.com/carrel-os/carrel/guest-agent/tarfs"
	"github.com/carrel-os/carrel/guest-agent/transport"
	"github.com/carrel-os/carrel/guest-agent/user"
)

// wrapListener is the identity, except in the test build of the agent
// (build tag carrel_misbehave), where it lets the agent misbehave on
// purpose; see misbehave.go.
var wrapListener = func(l net.Listener, _ *slog.Logger) net.Listener { return l }

// deviceWait bounds how long we wait for the transport's device to appear
// after its module loads (probing is asynchronous).
const deviceWait = 2 * time.Second

type options struct {
	transport  string
	vsockPort  uint
	serialName string
	listen     string
	// system: the guest's agent, run as a service of the image's init.
	system bool
	// mountState: set up the writable layer below this root, and exit.
	mountState string
}

func main() {
	pid1 := os.Getpid() == 1
	log := newLogger(os.Stderr)

	var o options
	fs := flag.NewFlagSet("carrel-agent", flag.ContinueOnError)
	fs.StringVar(&o.transport, "transport", "auto", "auto, vsock, serial, or unix (not as pid 1); auto prefers vsock")
	fs.UintVar(&o.vsockPort, "vsock-port", protocol.VsockPort, "vsock port to listen on")
	fs.StringVar(&o.serialName, "serial-name", protocol.SerialPortName, "name of the virtio-serial port")
	fs.StringVar(&o.listen, "listen", "", "unix socket path, for --transport unix")
	fs.BoolVar(&o.system, "system", false, "run as the guest's agent under the image's init system (a systemd service with Delegate=yes)")
	fs.StringVar(&o.mountState, "mount-state", "", "set up the VM's writable layer below this root (a systemd initrd's /sysroot), as carrel.state= says, and exit")
	if err := fs.Parse(os.Args[1:]); err != nil {
		if !pid1 {
			os.Exit(2)
		}
		// The kernel passes unknown command-line words to init; never die
		// over them.
		log.Warn("bad arguments; using defaults for the rest", "args", os.Args[1:], "err", err)
	}

	if o.mountState != "" && !pid1 {
		if err := initsys.MountState(log, o.mountState); err != nil {
			log.Error("writable layer", "err", err)
			fmt.Fprintf(os.Stderr, "%s %v\n", protocol.BootFailedMarker, err)
			os.Exit(1)
		}
		return
	}

	switch o.transport {
	case "auto", transport.Vsock, "serial", transport.Serial, transport.Unix:
	default:
		log.Error("unknown --transport; using auto", "transport", o.transport)
		if !pid1 {
			os.Exit(2)
		}
		o.transport = "auto"
	}

	ctx := context.Background()
	if pid1 {
		if err := initsys.Setup(log); err != nil {
			log.Error("setup", "err", err)
			if errors.Is(err, initsys.ErrWorkspace) || errors.Is(err, initsys.ErrRoot) {
				// Fail the boot (the kernel panics when PID 1 exits), with
				// the reason on the console, rather than serve from a
				// root that failed verification, or a workspace in memory
				// that carreld did not give the VM.
				fmt.Fprintf(os.Stderr, "%s %v\n", protocol.BootFailedMarker, err)
				os.Exit(1)
			}
		}
		if err := useConsole(); err != nil {
			log.Error("open console", "err", err)
		}
		ignoreSignals(log)
	} else {
		if o.system {
			if err := initsys.Service(log); err != nil {
				// The workspace carreld gave the VM is not there: do not
				// serve one in the root instead. systemd restarts us.
				log.Error("setup", "err", err)
				os.Exit(1)
			}
		}
		var stop context.CancelFunc
		ctx, stop = signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
		defer stop()
		// Orphans of our commands come back to us, as they would to PID 1.
		_ = unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
	}
	// The guest's agent, whether PID 1 or its init's service: it gives
	// commands the guest's network (the egress proxies), the image's
	// environment and the agent user's files.
	guest := pid1 || o.system
	reaper.Default()
	log.Info("starting", "version", server.Version, "pid1", pid1, "system", o.system, "transport", o.transport)
	if abi, err := sandbox.ABI(); err != nil {
		log.Warn("no Landlock: commands will run with no_new_privs only", "err", err)
	} else {
		log.Info("landlock available", "abi", abi)
	}
	// One sandbox for the agent's life: it outlives a serve that fails.
	sb := &sandbox.Guard{Log: log}
	w := watchWorkspace(log, pid1, o.system)
	eg := startEgress(ctx, log, guest)

	backoff := time.Second
	for {
		err := serve(ctx, log, o, pid1, sb, w, eg)
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			continue // only after a Shutdown whose power-off returned
		}
		if !pid1 {
			log.Error("serve", "err", err)
			os.Exit(1)
		}
		// PID 1 exiting panics the kernel: keep trying.
		log.Error("serve; retrying", "err", err, "in", backoff)
		time.Sleep(backoff)
		backoff = min(2*backoff, 10*time.Second)
	}
}

// workspace is how commands are grouped and watched; both parts may be
// nil.
type workspace struct {
	groups   *cgroups.Dir
	activity *activity.Monitor
}

// watchWorkspace gives each command a cgroup of its own (as PID 1, which
// owns the hierarchy, or as a service in the subtree its init delegated)
// and starts the watch of what commands do in the workspace (as root).
// What cannot be had is logged and done without.
func watchWorkspace(log *slog.Logger, pid1, system bool) workspace {
	var w workspace
	if pid1 || system {
		open := func() (*cgroups.Dir, error) { return cgroups.Open(cgroups.Mount, "carrel") }
		if !pid1 {
			open = func() (*cgroups.Dir, error) { return cgroups.OpenDelegated(cgroups.Mount) }
		}
		d, err := open()
		if err != nil {
			log.Warn("commands get no cgroup of their own", "err", err)
		} else {
			w.groups = d
			// The limit carreld set is applied to all commands together.
			if l, _ := initsys.ReadLimits(); l.MaxProcesses > 0 {
				if err := d.SetMaxProcesses(l.MaxProcesses); err != nil {
					log.Error("process limit not applied", "max", l.MaxProcesses, "err", err)
				} else {
					log.Info("process limit applied", "max", l.MaxProcesses)
				}
			}
		}
	}
	if os.Geteuid() != 0 {
		log.Info("not root: the workspace's activity is not watched")
		return w
	}
	opts := activity.Options{Root: exec.DefaultDir, Log: log}
	if w.groups != nil {
		opts.Cgroup = w.groups.ExecID
	}
	m, err := activity.Start(opts)
	if err != nil {
		log.Warn("the workspace's activity is not watched", "err", err)
		return w
	}
	w.activity = m
	return w
}

// serve listens on the chosen transport, prints the ready line, and serves
// until ctx ends or serving fails.
func serve(ctx context.Context, log *slog.Logger, o options, pid1 bool, sb *sandbox.Guard, w workspace, eg *egress.Service) error {
	l, name, err := listen(ctx, log, o, pid1)
	if err != nil {
		return err
	}
	log.Info("listening", "transport", name, "addr", l.Addr())
	l = wrapListener(l, log)
	fmt.Printf("%s transport=%s\n", protocol.ReadyMarker, name)
	cfg := server.Config{
		Transport: name,
		Log:       log,
		PowerOff:  func(reboot bool) { powerOff(log, pid1, o.system, reboot) },
		Sandbox:   sb,
		Runner:    &exec.Runner{Reaper: reaper.Default(), Sandbox: sb, Cgroups: w.groups},
		Files:     files.New(files.Options{Owner: fileOwner(log, pid1 || o.system), Sandbox: sb}),
	}
	if w.activity != nil {
		cfg.Runner.OnStart = w.activity.Started
		cfg.Activity = w.activity.Serve
	}
	if pid1 || o.system {
		// The image's environment for every command (a spec's "env").
		env, err := exec.ReadEnvironment(exec.EnvironmentFile)
		if err != nil {
			log.Warn("image environment", "err", err)
		}
		cfg.Runner.Env = env
	}
	if eg != nil {
		cfg.Egress = eg
		cfg.Runner.Env = append(cfg.Runner.Env, egress.Env()...)
	}
	return server.Serve(ctx, l, cfg)
}

// startEgress starts the egress proxies on the guest's loopback, the VM's
// only way out (in the guest; a development host has its own network).
// They outlive a serve that fails. nil if they cannot listen.
func startEgress(ctx context.Context, log *slog.Logger, guest bool) *egress.Service {
	if !guest {
		return nil
	}
	eg := egress.New(egress.Options{Log: log})
	hl, err := net.Listen("tcp", egress.HTTPProxyAddr)
	if err != nil {
		log.Error("no egress: the HTTP proxy cannot listen", "err", err)
		return nil
	}
	sl, err := net.Listen("tcp", egress.SOCKSProxyAddr)
	if err != nil {
		hl.Close()
		log.Error("no egress: the SOCKS5 proxy cannot listen", "err", err)
		return nil
	}
	go func() { log.Error("egress HTTP proxy stopped", "err", eg.ServeHTTPProxy(ctx, hl)) }()
	go func() { log.Error("egress SOCKS5 proxy stopped", "err", eg.ServeSOCKS5(ctx, sl)) }()
	log.Info("egress proxies listening", "http", egress.HTTPProxyAddr, "socks5", egress.SOCKSProxyAddr)
	return eg
}

// fileOwner is who owns what the host puts in the guest: the agent user,
// whose commands must be able to use it. Off the guest (a development
// host), files belong to whoever runs the agent.
func fileOwner(log *slog.Logger, guest bool) *tarfs.Owner {
	if !guest {
		return nil
	}
	u, err := user.Files{}.Lookup("agent")
	if err != nil {
		log.Warn("no agent user: files from the host stay owned by root", "err", err)
		return nil
	}
	return &tarfs.Owner{UID: int(u.UID), GID: int(u.GID)}
}

func listen(ctx context.Context, log *slog.Logger, o options, pid1 bool) (net.Listener, string, error) {
	kind := o.transport
	if kind == "auto" {
		var err error
		if kind, err = transport.Detect(ctx, o.serialName, deviceWait); err != nil {
			return nil, "", err
		}
	}
	switch kind {
	case transport.Vsock:
		l, err := transport.ListenVsock(uint32(o.vsockPort), log)
		return l, transport.Vsock, err
	case "serial", transport.Serial:
		// Wait for the port (and its name) to show up.
		wctx, cancel := context.WithTimeout(ctx, deviceWait)
		defer cancel()
		for {
			_, err := transport.FindSerialPort(o.serialName)
			if err == nil || wctx.Err() != nil {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		l, err := transport.ListenSerial(o.serialName)
		return l, transport.Serial, err
	case transport.Unix:
		if pid1 || o.listen == "" {
			return nil, "", errors.New("--transport unix needs --listen and is for development hosts only")
		}
		if fi, err := os.Lstat(o.listen); err == nil && fi.Mode()&os.ModeSocket != 0 {
			os.Remove(o.listen) // stale socket from an earlier run
		}
		l, err := net.Listen("unix", o.listen)
		return l, transport.Unix, err
	}
	return nil, "", fmt.Errorf("unknown transport %q", o.transport)
}

func powerOff(log *slog.Logger, pid1, system, reboot bool) {
	if system && !pid1 {
		// The init system stops the services, unmounts and powers off.
		verb := "poweroff"
		if reboot {
			verb = "reboot"
		}
		out, err := osexec.Command("systemctl", "--no-block", verb).CombinedOutput()
		log.Info("asked the init system to power off", "verb", verb, "err", err, "output", strings.TrimSpace(string(out)))
		if err == nil {
			return
		}
		// No systemctl: sync and do it ourselves.
		unix.Sync()
		cmd := unix.LINUX_REBOOT_CMD_POWER_OFF
		if reboot {
			cmd = unix.LINUX_REBOOT_CMD_RESTART
		}
		log.Error("power off", "err", unix.Reboot(cmd))
		return
	}
	if !pid1 {
		log.Info("not pid 1: exiting instead of powering off", "reboot", reboot)
		os.Exit(0)
	}
	var err error
	if reboot {
		err = initsys.Reboot(log)
	} else {
		err = initsys.PowerOff(log)
	}
	log.Error("power off", "err", err)
}

// useConsole points stdin at /dev/null and stdout and stderr at
// /dev/console, whatever the kernel gave us (which depends on whether the
// initramfs has /dev/console).
func useConsole() error {
	console, err := os.OpenFile("/dev/console", os.O_WRONLY|unix.O_NOCTTY, 0)
	if err != nil {
		return err
	}
	defer console.Close()
	null, err := os.Open(os.DevNull)
	if err != nil {
		return err
	}
	defer null.Close()
	return errors.Join(
		unix.Dup3(int(null.Fd()), 0, 0),
		unix.Dup3(int(console.Fd()), 1, 0),
		unix.Dup3(int(console.Fd()), 2, 0),
	)
}

// ignoreSignals keeps signals that would end the Go program from killing
// PID 1 (which would panic the kernel). Handlers, unlike SIG_IGN, are not
// inherited by the commands we start.
func ignoreSignals(log *slog.Logger) {
	c := make(chan os.Signal, 4)
	signal.Notify(c, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP, syscall.SIGQUIT, syscall.SIGUSR1, syscall.SIGUSR2, syscall.SIGPWR)
	go func() {
		for sig := range c {
			log.Warn("ignoring signal", "signal", sig)
		}
	}()
}

func newLogger(w io.Writer) *slog.Logger {
	return slog.New(slog.NewTextHandler(&prefixWriter{w: w, prefix: []byte("carrel-agent: ")}, nil))
}

// prefixWriter prefixes each write (one slog record) with prefix.
type prefixWriter struct {
	mu     sync.Mutex
	w      io.Writer
	prefix []byte
	buf    []byte
}

func (p *prefixWriter) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.buf = append(append(p.buf[:0], p.prefix...), b...)
	if _, err := p.w.Write(p.buf); err != nil {
		return 0, err
	}
	return len(b), nil
}
