//go:build linux

package sandbox

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// ErrConfine marks a command that was not started because its thread
// could not be confined.
var ErrConfine = errors.New("cannot confine the command")

// errReplaced: the sandbox a thread was to be confined to was replaced
// first; Spawn confines a thread to the newer one.
var errReplaced = fmt.Errorf("%w: the sandbox was replaced meanwhile", ErrConfine)

// Spawn calls start, which must create the command's process (through
// os.StartProcess), on an OS thread that has no_new_privs set and, if the
// sandbox in force has Landlock, is inside its Landlock domain. It reports
// whether the command was landlocked. If the thread cannot be confined,
// start is not called and the error wraps ErrConfine: a command never runs
// with less than it should. A nil Guard gives no_new_privs only, on a
// fresh thread each time. Spawns are serialised (the reaper forks one at a
// time anyway).
//
// Why a thread, and why this is sound:
//
//   - prctl(PR_SET_NO_NEW_PRIVS) and landlock_restrict_self (without
//     LANDLOCK_RESTRICT_SELF_TSYNC) act on the calling thread only, so the
//     rest of the agent stays unconfined: it must keep serving files
//     outside the roots, and replace the sandbox later.
//   - runtime.LockOSThread keeps the spawner's goroutine, and nothing
//     else, on the thread for as long as the thread lives: the runtime
//     never schedules another goroutine on a locked thread.
//   - os.StartProcess reaches syscall.forkExec, which clones the child
//     with a raw clone/clone3 (CLONE_VFORK|CLONE_VM) from the calling
//     thread (syscall/exec_linux.go, forkAndExecInChild1). The child's
//     credentials, the Landlock domain among them, are copied from that
//     thread, as is its no_new_privs flag; both survive execve.
//   - The thread is confined once, for one sandbox, and forks every
//     command started under it: confining a fresh thread per command
//     (creating it, restricting it, destroying it) cost about 2.5 ms a
//     command under TCG. When the sandbox is replaced, the next Spawn
//     retires the thread: its goroutine exits still locked, so the
//     runtime destroys the thread instead of reusing it. (It would park
//     the main thread for good instead, so that one is never used.) While
//     locked, any thread the runtime needs is created by its template
//     thread, not cloned from this one (runtime.newm).
//   - Children of a thread that exits pass to another thread of the
//     process, so the reaper's wait4(-1) still collects them; nothing
//     here sets Pdeathsig, which would fire when the thread exits.
//
// The alternative, re-executing the agent as a trampoline that confines
// itself and then execs the command, costs an exec of the whole agent
// binary per command, which under TCG is milliseconds.
func (g *Guard) Spawn(start func() error) (landlocked bool, err error) {
	if g == nil {
		done := make(chan spawnResult, 1)
		go g.spawnOnce(start, done)
		r := <-done
		return r.landlocked, r.err
	}
	g.spawnMu.Lock()
	defer g.spawnMu.Unlock()
	sp, err := g.spawnerFor(g.Current())
	for errors.Is(err, errReplaced) {
		sp, err = g.spawnerFor(g.Current()) // take the newer sandbox
	}
	if err != nil {
		return false, err
	}
	done := make(chan error, 1)
	sp.jobs <- spawnJob{start: start, done: done}
	return sp.landlocked, <-done
}

type spawnResult struct {
	landlocked bool
	err        error
}

// A spawner is a thread confined to one sandbox that forks the commands
// started under it (see Spawn).
type spawner struct {
	sb         *Sandbox // nil: no_new_privs alone
	landlocked bool
	tid        int
	jobs       chan spawnJob
}

type spawnJob struct {
	start func() error
	done  chan<- error
}

// spawnerFor returns the spawner of sandbox sb, retiring one confined to
// another and confining a new thread if need be. g.spawnMu must be held.
func (g *Guard) spawnerFor(sb *Sandbox) (*spawner, error) {
	if g.spawner != nil && g.spawner.sb == sb {
		return g.spawner, nil
	}
	if g.spawner != nil {
		close(g.spawner.jobs) // its thread ends
		g.spawner = nil
	}
	sp := &spawner{jobs: make(chan spawnJob)}
	ready := make(chan error, 1)
	go g.runSpawner(sp, sb, ready)
	if err := <-ready; err != nil {
		return nil, err
	}
	g.spawner = sp
	return sp, nil
}

// runSpawner confines the thread it runs on to sb and runs sp's jobs there
// until sp.jobs is closed; then it exits still locked, ending the thread.
// If the thread cannot be confined, it reports why and ends at once.
func (g *Guard) runSpawner(sp *spawner, sb *Sandbox, ready chan<- error) {
	runtime.LockOSThread() // never unlocked, but on the main thread
	if unix.Gettid() == unix.Getpid() {
		// The runtime parks a main thread whose goroutine exits locked,
		// rather than ending it: keep it clean, and hand over to another
		// thread (while we hold this one, that cannot be the main one).
		inner := make(chan error, 1)
		go g.runSpawner(sp, sb, inner)
		ready <- <-inner
		runtime.UnlockOSThread()
		return
	}
	var err error
	sp.sb, sp.tid = sb, unix.Gettid()
	sp.landlocked, err = confineThread(sb)
	ready <- err
	if err != nil {
		return
	}
	for job := range sp.jobs {
		job.done <- job.start()
	}
}

// spawnOnce confines a fresh thread to no_new_privs, calls start there and
// leaves the thread to die: for a nil Guard.
func (g *Guard) spawnOnce(start func() error, done chan<- spawnResult) {
	runtime.LockOSThread()
	if unix.Gettid() == unix.Getpid() {
		inner := make(chan spawnResult, 1)
		go g.spawnOnce(start, inner)
		done <- <-inner
		runtime.UnlockOSThread()
		return
	}
	var r spawnResult
	r.landlocked, r.err = confineThread(nil)
	if r.err == nil {
		r.err = start()
	}
	done <- r
}

// confineThread sets no_new_privs on the calling thread and, if sb has
// Landlock, restricts the thread to it. It also gives the thread the
// agent's own timer slack, which its commands inherit.
func confineThread(sb *Sandbox) (bool, error) {
	if ns := commandSlack(); ns > 0 {
		_ = unix.Prctl(unix.PR_SET_TIMERSLACK, uintptr(ns), 0, 0, 0)
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return false, fmt.Errorf("%w: prctl(PR_SET_NO_NEW_PRIVS): %w", ErrConfine, err)
	}
	if sb == nil || sb.rules == nil {
		return false, nil
	}
	ok, err := sb.rules.restrictThread()
	if err != nil {
		return false, fmt.Errorf("%w: landlock_restrict_self: %w", ErrConfine, err)
	}
	if !ok {
		// Replaced, and its ruleset closed, since it was looked up: the
		// thread is not confined to it, so it forks nothing.
		return false, errReplaced
	}
	return true, nil
}

// commandSlack is the timer slack, in ns, that commands start with: the
// agent's own, as its main thread has it (/proc/self/timerslack_ns). The
// agent slows the runtime's sysmon thread (agent.slowSysmon), and the
// runtime may clone a thread from it, the spawner's among them, which then
// inherits sysmon's slack; a command must not. 0 if it cannot be read:
// from any thread but the main one, reading it needs CAP_SYS_NICE, which
// the agent has as root; a spawner then leaves its slack as it is.
var commandSlack = sync.OnceValue(func() uint64 {
	b, err := os.ReadFile("/proc/self/timerslack_ns")
	if err != nil {
		return 0
	}
	ns, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0
	}
	return ns
})

// stopSpawner retires the spawner's thread, if any (tests: a Guard of
// carrel-agent lives as long as the agent).
func (g *Guard) stopSpawner() {
	g.spawnMu.Lock()
	defer g.spawnMu.Unlock()
	if g.spawner != nil {
		close(g.spawner.jobs)
		g.spawner = nil
	}
}

// spawnerTID is the spawner thread's id, or 0 when there is none.
func (g *Guard) spawnerTID() int {
	g.spawnMu.Lock()
	defer g.spawnMu.Unlock()
	if g.spawner == nil {
		return 0
	}
	return g.spawner.tid
}
