//go:build linux

package activity

import (
	"sync"
	"time"
)

// verdict is what lineage knows of a process.
type verdict uint8

const (
	// notOurs: the process is not one of the agent's commands or their
	// descendants (or it cannot be told any more).
	notOurs verdict = iota
	// ours: it is; the exec id is known.
	ours
	// pendingID: a command the agent has just started, whose id Started
	// has not brought yet (or a descendant of one).
	pendingID
)

// maxDepth bounds a walk up the recorded parents.
const maxDepth = 64

// lineage tells which command, if any, a process belongs to. Commands are
// the agent's own children, named by Started. Their descendants are
// learnt from the kernel's process events as each is forked, so that a
// process is attributed even after it has exited (a short `mv` is gone
// long before its rename is read) and even when its parent has died and
// it has been reparented. A process not seen forked (the connector lost
// it, or is missing) is looked up in the cgroups instead, while it lives.
type lineage struct {
	self   int32                        // the agent's pid: never a command
	cgroup func(pid int) (string, bool) // nil without cgroups
	max    int                          // entries at most
	grace  time.Duration                // an exited process is remembered this long

	mu     sync.Mutex
	procs  map[int32]*proc
	exited []exitMark // in exit order
	// untracked counts forks of our processes not recorded for want of
	// room (max reached).
	untracked uint64
}

// proc is one process that is, or may be, a command's.
type proc struct {
	id     string // its command's id; "" until known
	parent int32  // where to look for the id while it is ""
	gone   time.Time
}

type exitMark struct {
	pid int32
	at  time.Time
}

func newLineage(self int, cgroup func(int) (string, bool), max int, grace time.Duration) *lineage {
	return &lineage{self: int32(self), cgroup: cgroup, max: max, grace: grace, procs: make(map[int32]*proc)}
}

// started names the command the agent has started as pid.
func (l *lineage) started(pid int, id string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	p := l.procs[int32(pid)]
	if p == nil || !p.gone.IsZero() {
		p = &proc{parent: l.self}
		l.add(int32(pid), p)
	}
	p.id = id
}

// event records a fork or an exit from the connector.
func (l *lineage) event(ev procEvent, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !ev.fork {
		if ev.pid != ev.tgid {
			return // a thread
		}
		if p := l.procs[ev.tgid]; p != nil && p.gone.IsZero() {
			p.gone = now
			l.exited = append(l.exited, exitMark{ev.tgid, now})
		}
		return
	}
	if ev.pid != ev.tgid || ev.tgid <= 0 {
		return // a new thread, not a new process
	}
	child := ev.tgid
	if old := l.procs[child]; old != nil && old.gone.IsZero() && old.id != "" && ev.parentTgid == l.self {
		return // Started was told of this command before its fork was read
	}
	var p *proc
	switch parent := l.procs[ev.parentTgid]; {
	case ev.parentTgid == l.self:
		p = &proc{parent: l.self} // a command: Started brings its id
	case parent != nil && parent.id != "":
		p = &proc{id: parent.id}
	case parent != nil:
		p = &proc{parent: ev.parentTgid} // below a command whose id is pending
	default:
		// A parent forked before we listened, or lost: its group says.
		id, ok := l.cgroupOf(ev.parentTgid)
		if !ok {
			delete(l.procs, child) // pid reused by a process not ours
			return
		}
		p = &proc{id: id}
	}
	l.add(child, p)
}

// add records p as pid, making room by forgetting exited processes; with
// no room left, p is not recorded (counted in untracked).
func (l *lineage) add(pid int32, p *proc) {
	if _, ok := l.procs[pid]; !ok && len(l.procs) >= l.max {
		l.expire(time.Time{}, true)
		if len(l.procs) >= l.max {
			l.untracked++
			return
		}
	}
	l.procs[pid] = p
}

// expire forgets processes that exited more than grace before now (all
// exited ones, with all).
func (l *lineage) expire(now time.Time, all bool) {
	i := 0
	for ; i < len(l.exited); i++ {
		m := l.exited[i]
		if !all && now.Sub(m.at) < l.grace {
			break
		}
		if p := l.procs[m.pid]; p != nil && p.gone.Equal(m.at) {
			delete(l.procs, m.pid)
		}
	}
	l.exited = append(l.exited[:0], l.exited[i:]...)
}

// prune is expire under the lock.
func (l *lineage) prune(now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.expire(now, false)
}

// resolve tells whom process pid belongs to.
func (l *lineage) resolve(pid int32) (string, verdict) {
	if pid <= 0 || pid == l.self {
		return "", notOurs
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	p := l.procs[pid]
	if p == nil {
		if id, ok := l.cgroupOf(pid); ok {
			return id, ours
		}
		return "", notOurs
	}
	for range maxDepth {
		switch {
		case p.id != "":
			return p.id, ours
		case p.parent == l.self:
			return "", pendingID
		}
		if p = l.procs[p.parent]; p == nil {
			return "", notOurs
		}
	}
	return "", notOurs
}

func (l *lineage) cgroupOf(pid int32) (string, bool) {
	if l.cgroup == nil {
		return "", false
	}
	return l.cgroup(int(pid))
}

// size is how many processes are recorded.
func (l *lineage) size() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.procs)
}
