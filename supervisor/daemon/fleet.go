package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/supervisor/api"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/fence"
	"github.com/carrel-os/carrel/supervisor/registry"
	"github.com/carrel-os/carrel/supervisor/vm"
)

// FleetConfig makes carreld a node of a Kubernetes fleet, through its
// node helper (cmd/carrel-node): the helper registers the Node, renews
// its Lease, publishes the GPUs and boots the AgentVM runs placed here,
// and carreld fences the runs' VMs when the Lease lapses.
type FleetConfig struct {
	// Kubeconfig reaches the API server as the Node's own identity
	// (user system:node:<name>, group system:nodes).
	Kubeconfig string
	// NodeName is the Node's name ("": carrel-<hostname>).
	NodeName string
	// FenceAfter: once the Lease has gone unrenewed this long, the fleet
	// VMs are stopped and their calls refused. It must be well under the
	// controller's --node-loss-timeout (default 30 s of its 60 s).
	FenceAfter time.Duration
	// RenewInterval is how often the Lease is renewed (default 10 s).
	RenewInterval time.Duration
	// CPUs and Memory are what the Node offers (0: the host's).
	CPUs, Memory int64
	// FakeGPUs, for fleet tests, is the sysfs root of a fake host: its
	// GPUs are published and allocated, and VMs boot without them.
	FakeGPUs string
	// Helper is the carrel-node binary (carreld's --fleet-helper).
	Helper string
}

// newFence is the fleet VMs' fence: the API asks it before acting on a
// VM, and it stops the fleet VMs when the helper's renewals stop.
func newFence(ctx context.Context, fc *FleetConfig, stateDir string, mgr *vm.Manager, log *slog.Logger) *fence.Fence {
	if fc.FenceAfter == 0 {
		fc.FenceAfter = 30 * time.Second
	}
	f := fence.New(fence.Config{
		After: fc.FenceAfter,
		State: filepath.Join(stateDir, "fleet-heard"),
		Log:   log.With("subsystem", "fence"),
		Labels: func(name string) map[string]string {
			st, err := mgr.Get(name)
			if err != nil {
				return nil
			}
			return st.Labels
		},
		Fleet: func() []string {
			var out []string
			for _, st := range mgr.List() {
				if st.Labels[fence.LabelRun] != "" && st.State != registry.StateStopped {
					out = append(out, st.Name)
				}
			}
			return out
		},
		Stop: func(ctx context.Context, name string) error {
			_, err := mgr.Stop(ctx, name, true)
			return err
		},
	})
	// Before any call is served: a carreld restarted after its time ran
	// out stops the fleet VMs that ran on meanwhile.
	f.Check(ctx)
	return f
}

// runFleet runs the node helper until ctx ends, starting it again when
// it exits (after 1 s, doubling to 30 s while it keeps failing), and the
// fence beside it.
func runFleet(ctx context.Context, cfg Config, f *fence.Fence, h http.Handler, auditLog *audit.Log, log *slog.Logger) {
	fc := cfg.Fleet
	log = log.With("subsystem", "fleet")
	go f.Watch(ctx, 250*time.Millisecond)
	helper := fc.Helper
	args := []string{"--kubeconfig", fc.Kubeconfig, "--fence-after", fc.FenceAfter.String(), "--driver", cfg.Driver}
	for flag, v := range map[string]string{"--node-name": fc.NodeName, "--fake-gpus": fc.FakeGPUs} {
		if v != "" {
			args = append(args, flag, v)
		}
	}
	if fc.RenewInterval > 0 {
		args = append(args, "--renew-interval", fc.RenewInterval.String())
	}
	if fc.CPUs > 0 {
		args = append(args, "--cpus", strconv.FormatInt(fc.CPUs, 10))
	}
	if fc.Memory > 0 {
		args = append(args, "--memory", strconv.FormatInt(fc.Memory, 10))
	}
	backoff := time.Second
	for ctx.Err() == nil {
		start := time.Now()
		err := runHelper(ctx, helper, args, f, h, auditLog)
		if ctx.Err() != nil {
			return
		}
		if time.Since(start) > time.Minute {
			backoff = time.Second
		}
		log.Error("fleet node helper exited; starting it again", "helper", helper, "err", err, "in", backoff)
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 30*time.Second)
	}
}

// runHelper runs the helper once: it serves carreld's API on one socket
// and reads renewal reports from another, which also carries carreld's
// latest audit checkpoint the other way.
func runHelper(ctx context.Context, helper string, args []string, f *fence.Fence, h http.Handler, auditLog *audit.Log) error {
	apiOurs, apiTheirs, err := socketPair()
	if err != nil {
		return err
	}
	defer apiTheirs.Close()
	repOurs, repTheirs, err := socketPair()
	if err != nil {
		apiOurs.Close()
		return err
	}
	defer repTheirs.Close()
	cmd := exec.CommandContext(ctx, helper, args...)
	cmd.ExtraFiles = []*os.File{apiTheirs, repTheirs}
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 10 * time.Second
	if err := cmd.Start(); err != nil {
		apiOurs.Close()
		repOurs.Close()
		return err
	}
	apiTheirs.Close()
	repTheirs.Close()
	hctx, cancel := context.WithCancel(ctx)
	defer cancel()
	apiConn, err := net.FileConn(apiOurs)
	apiOurs.Close()
	if err != nil {
		repOurs.Close()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return err
	}
	repConn, err := net.FileConn(repOurs)
	repOurs.Close()
	if err != nil {
		apiConn.Close()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return err
	}
	defer repConn.Close()
	go func() { _ = api.Serve(hctx, &oneConn{c: apiConn, done: hctx.Done()}, h) }()
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() {
		if err := f.ReadReports(repConn); err != nil && hctx.Err() == nil {
			slog.Error("fleet node helper's reports", "err", err)
			_ = cmd.Process.Kill()
		}
	})
	wg.Go(func() { sendCheckpoints(hctx, repConn, auditLog) })
	err = cmd.Wait()
	cancel()
	repConn.Close()
	return err
}

// sendCheckpoints tells the helper the audit log's latest checkpoint
// every few seconds, for the AgentVMs' status.
func sendCheckpoints(ctx context.Context, c net.Conn, l *audit.Log) {
	t := time.NewTicker(5 * time.Second)
	defer t.Stop()
	last := ""
	for {
		if cp := l.Checkpoint(); cp != nil {
			origin, _, _ := strings.Cut(string(cp.Note), "\n")
			line := fmt.Sprintf("checkpoint %s %d %s\n", origin, cp.Size, cp.Root)
			if line != last && !strings.ContainsAny(origin, " \t") {
				_ = c.SetWriteDeadline(time.Now().Add(5 * time.Second))
				if _, err := c.Write([]byte(line)); err != nil {
					return
				}
				last = line
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func socketPair() (ours, theirs *os.File, err error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("socketpair: %w", err)
	}
	return os.NewFile(uintptr(fds[0]), "fleet"), os.NewFile(uintptr(fds[1]), "fleet-helper"), nil
}

// oneConn is a listener that accepts one connection, then waits for
// done. Its connection is a socketpair's end: its peer credentials are
// carreld's own, so the helper's calls are carreld's.
type oneConn struct {
	mu   sync.Mutex
	c    net.Conn
	done <-chan struct{}
}

func (l *oneConn) Accept() (net.Conn, error) {
	l.mu.Lock()
	c := l.c
	l.c = nil
	l.mu.Unlock()
	if c != nil {
		return c, nil
	}
	<-l.done
	return nil, net.ErrClosed
}

func (l *oneConn) Close() error   { return nil }
func (l *oneConn) Addr() net.Addr { return fleetAddr{} }

type fleetAddr struct{}

func (fleetAddr) Network() string { return "unix" }
func (fleetAddr) String() string  { return "carrel-node" }
