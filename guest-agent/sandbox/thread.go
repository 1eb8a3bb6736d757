//go:build linux

package sandbox

import (
	"errors"
	"fmt"
	"runtime"

	"golang.org/x/sys/unix"
)

// ErrConfine marks a command that was not started because its thread
// could not be confined.
var ErrConfine = errors.New("cannot confine the command")

// Spawn calls start, which must create the command's process (through
// os.StartProcess), on a fresh OS thread that has no_new_privs set and, if
// the sandbox in force has Landlock, is inside its Landlock domain. It
// reports whether the command was landlocked. If the thread cannot be
// confined, start is not called and the error wraps ErrConfine: a command
// never runs with less than it should. A nil Guard gives no_new_privs only.
//
// Why a thread, and why this is sound:
//
//   - prctl(PR_SET_NO_NEW_PRIVS) and landlock_restrict_self (without
//     LANDLOCK_RESTRICT_SELF_TSYNC) act on the calling thread only, so the
//     rest of the agent stays unconfined: it must keep serving files
//     outside the roots, and replace the sandbox later.
//   - runtime.LockOSThread keeps this goroutine, and nothing else, on the
//     thread from the prctl to the fork.
//   - os.StartProcess reaches syscall.forkExec, which clones the child
//     with a raw clone/clone3 (CLONE_VFORK|CLONE_VM) from the calling
//     thread (syscall/exec_linux.go, forkAndExecInChild1). The child's
//     credentials, the Landlock domain among them, are copied from that
//     thread, as is its no_new_privs flag; both survive execve.
//   - The goroutine exits still locked, so the runtime destroys the thread
//     instead of reusing it. (It would park the main thread for good
//     instead, so that one is never used.) While locked, any thread the
//     runtime needs is created by its template thread, not cloned from
//     this one (runtime.newm).
//   - Children of a thread that exits pass to another thread of the
//     process, so the reaper's wait4(-1) still collects them; nothing
//     here sets Pdeathsig, which would fire when the thread exits.
//
// The alternative, re-executing the agent as a trampoline that confines
// itself and then execs the command, costs an exec of the whole agent
// binary per command, which under TCG is milliseconds; a fresh thread
// costs microseconds.
func (g *Guard) Spawn(start func() error) (landlocked bool, err error) {
	done := make(chan spawnResult, 1)
	go g.spawn(start, done)
	r := <-done
	return r.landlocked, r.err
}

type spawnResult struct {
	landlocked bool
	err        error
}

// spawn confines the thread it runs on, calls start there and leaves the
// thread to die.
func (g *Guard) spawn(start func() error, done chan<- spawnResult) {
	runtime.LockOSThread() // never unlocked, but on the main thread
	if unix.Gettid() == unix.Getpid() {
		// The runtime parks a main thread whose goroutine exits locked,
		// rather than ending it: keep it clean, and hand over to another
		// thread (while we hold this one, that cannot be the main one).
		inner := make(chan spawnResult, 1)
		go g.spawn(start, inner)
		done <- <-inner
		runtime.UnlockOSThread()
		return
	}
	var r spawnResult
	r.landlocked, r.err = g.confineThread()
	if r.err == nil {
		r.err = start()
	}
	done <- r
}

// confineThread sets no_new_privs on the calling thread and, if the
// sandbox in force has Landlock, restricts the thread to it.
func (g *Guard) confineThread() (bool, error) {
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return false, fmt.Errorf("%w: prctl(PR_SET_NO_NEW_PRIVS): %w", ErrConfine, err)
	}
	for {
		sb := g.Current()
		if sb == nil || sb.rules == nil {
			return false, nil
		}
		ok, err := sb.rules.restrictThread()
		if err != nil {
			return false, fmt.Errorf("%w: landlock_restrict_self: %w", ErrConfine, err)
		}
		if ok {
			return true, nil
		}
		// Replaced while we looked: take the newer sandbox.
	}
}
