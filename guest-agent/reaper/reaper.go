//go:build linux

// Package reaper is the one place in carrel-agent that waits for child
// processes.
//
// As PID 1 the agent must reap every orphan the kernel reparents to it, which
// means calling wait4(-1). That steals exit statuses from os/exec's Wait, so
// carrel-agent never uses os/exec: every child is started through the Reaper,
// which registers its pid before the child can be reaped and hands its status
// to the one waiter that asked for it. Statuses of unregistered pids (orphans)
// are discarded.
package reaper

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// Reaper starts child processes and collects their exit statuses.
type Reaper struct {
	mu      sync.Mutex // held across fork and across each wait4
	procs   map[int]*Process
	orphans atomic.Uint64
}

var defaultReaper = sync.OnceValue(func() *Reaper {
	r := &Reaper{procs: make(map[int]*Process)}
	sigc := make(chan os.Signal, 1)
	signal.Notify(sigc, unix.SIGCHLD)
	r.reapAll() // zombies from before we listened
	go func() {
		for range sigc {
			r.reapAll()
		}
	}()
	return r
})

// Default returns the process-wide Reaper, starting it on first use. There is
// only one: two reapers would steal each other's children. Once it runs, no
// other code in the process may wait for children (os/exec's Cmd.Wait,
// os.Process.Wait): their statuses may already be gone.
func Default() *Reaper { return defaultReaper() }

// Orphans returns how many unregistered children have been reaped.
func (r *Reaper) Orphans() uint64 { return r.orphans.Load() }

// Start starts a process like os.StartProcess (name is the program path, not
// looked up in PATH) and registers it so that its exit status reaches
// Process.Wait.
func (r *Reaper) Start(name string, argv []string, attr *os.ProcAttr) (*Process, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	op, err := os.StartProcess(name, argv, attr)
	if err != nil {
		return nil, err
	}
	p := &Process{Pid: op.Pid, r: r, done: make(chan struct{})}
	// We never wait through op; drop its pidfd. Signals go through kill(2)
	// under r.mu, which is safe because the pid cannot be reused before we
	// reap it.
	_ = op.Release()
	r.procs[p.Pid] = p
	return p, nil
}

func (r *Reaper) reapAll() {
	for {
		if !r.reapOne() {
			return
		}
	}
}

// reapOne reaps one exited child and reports whether there may be more.
func (r *Reaper) reapOne() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	var ws unix.WaitStatus
	pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
	switch {
	case errors.Is(err, unix.EINTR):
		return true
	case err != nil || pid <= 0: // ECHILD: no children; 0: none exited yet
		return false
	}
	p, ok := r.procs[pid]
	if !ok {
		r.orphans.Add(1)
		return true
	}
	delete(r.procs, pid)
	p.status = ws
	close(p.done)
	return true
}

// Process is a child started by a Reaper.
type Process struct {
	Pid int

	r      *Reaper
	done   chan struct{}
	status unix.WaitStatus // valid once done is closed
}

// Done is closed once the process has been reaped.
func (p *Process) Done() <-chan struct{} { return p.done }

// Wait returns the exit status once the process has been reaped, or ctx's
// error if ctx ends first (the process keeps running). Wait may be called any
// number of times, from any goroutine.
func (p *Process) Wait(ctx context.Context) (unix.WaitStatus, error) {
	select {
	case <-p.done:
		return p.status, nil
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// Signal sends sig to the process. It returns os.ErrProcessDone once the
// process has been reaped, and never signals a reused pid.
func (p *Process) Signal(sig unix.Signal) error {
	return p.kill(p.Pid, sig)
}

// SignalGroup sends sig to the process group whose id is the process's pid,
// i.e. the group of a process started with SysProcAttr.Setpgid. It returns
// os.ErrProcessDone once the leader has been reaped: after that the group id
// could name a new group.
func (p *Process) SignalGroup(sig unix.Signal) error {
	return p.kill(-p.Pid, sig)
}

func (p *Process) kill(pid int, sig unix.Signal) error {
	p.r.mu.Lock()
	defer p.r.mu.Unlock()
	select {
	case <-p.done:
		return os.ErrProcessDone
	default:
	}
	if err := unix.Kill(pid, sig); err != nil {
		return fmt.Errorf("kill %d: %w", pid, err)
	}
	return nil
}
