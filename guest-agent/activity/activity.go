//go:build linux

// Package activity watches what the commands carrel-agent started do in
// the workspace, through fanotify, and hands it to the host in batches
// (the Activity call).
//
// What is watched: the whole file system holding the workspace
// (FAN_MARK_FILESYSTEM), for opens, writes, creates, deletes and moves
// (FAN_OPEN, FAN_MODIFY, FAN_CREATE, FAN_DELETE, FAN_MOVED_FROM,
// FAN_MOVED_TO; directories' own events with FAN_ONDIR, though not their
// opens). Paths come from the directory handle and name the kernel reports
// (FAN_REPORT_DFID_NAME), opened with open_by_handle_at against the
// workspace and read back from /proc/self/fd; only paths in the workspace
// are reported.
//
// Whose events: only those of the commands the agent started (Exec and
// Process) and of every process they started in turn. The agent's own
// events (its FileService) are never reported. Which command a process
// belongs to is learnt as it is forked, from the kernel's process events
// connector, so that a process is attributed even after it has exited or
// been reparented; see lineage. A process the connector did not show is
// looked up by its cgroup while it lives (package cgroups).
//
// What is lost is counted, never silent, in Batch.Dropped: events over the
// queue's bounds (while no one reads, or the reader is slow), the kernel's
// queue overflowing (counted once per overflow), and events whose path
// could not be found (its directory removed before the event was read, and
// never seen before). The watch never blocks the file system or the agent:
// fanotify's notification class does not wait for the reader, and the
// reader never waits for the host.
//
// Repeats are merged: an open or write of a path by the process that had
// one reported less than Options.Coalesce ago is not reported again.
package activity

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

// Defaults for Options.
const (
	DefaultRoot          = "/workspace"
	DefaultQueue         = 4096
	DefaultQueueBytes    = 4 << 20
	DefaultFlushInterval = 100 * time.Millisecond
	DefaultCoalesce      = 100 * time.Millisecond
	DefaultMaxBatch      = 256
	// DefaultMaxBatchBytes keeps a batch's paths under the 64 KiB of JSON
	// an audit record may hold.
	DefaultMaxBatchBytes = 48 << 10
	DefaultMaxProcs      = 32768
	DefaultExitGrace     = 10 * time.Second
	DefaultPendingWait   = time.Second
	DefaultDirCache      = 4096
)

// MaxPathBytes is the longest path reported; an event with a longer one is
// counted as dropped.
const MaxPathBytes = 4096

// Op is what a process did to a path.
type Op uint8

const (
	Open Op = iota + 1
	Modify
	Create
	Delete
	MoveFrom
	MoveTo
)

func (o Op) String() string {
	switch o {
	case Open:
		return "open"
	case Modify:
		return "modify"
	case Create:
		return "create"
	case Delete:
		return "delete"
	case MoveFrom:
		return "move_from"
	case MoveTo:
		return "move_to"
	}
	return "unknown"
}

var protoOps = map[Op]agentv1.ActivityOp{
	Open:     agentv1.ActivityOp_ACTIVITY_OP_OPEN,
	Modify:   agentv1.ActivityOp_ACTIVITY_OP_MODIFY,
	Create:   agentv1.ActivityOp_ACTIVITY_OP_CREATE,
	Delete:   agentv1.ActivityOp_ACTIVITY_OP_DELETE,
	MoveFrom: agentv1.ActivityOp_ACTIVITY_OP_MOVE_FROM,
	MoveTo:   agentv1.ActivityOp_ACTIVITY_OP_MOVE_TO,
}

// Event is one thing a command did.
type Event struct {
	Op Op
	// Path is absolute and in the workspace. Names are the kernel's bytes:
	// they may not be UTF-8.
	Path   string
	Pid    int
	ExecID string
	// Time is when the event was read.
	Time time.Time
}

// Batch is what one message carries.
type Batch struct {
	Events []Event
	// Dropped counts events lost since the last batch.
	Dropped uint64
}

// Options tunes a Monitor. Zero fields take the defaults.
type Options struct {
	// Root is the workspace.
	Root string
	// Self is the agent's pid, whose events are never reported; zero means
	// os.Getpid().
	Self int
	// Cgroup tells the command of a live process by its cgroup
	// (cgroups.Dir.ExecID); nil means no cgroups.
	Cgroup func(pid int) (string, bool)
	// Queue and QueueBytes bound the events held for the host (roughly,
	// for QueueBytes: their paths); the rest are dropped and counted.
	Queue      int
	QueueBytes int
	// FlushInterval is how often events read are attributed and queued.
	FlushInterval time.Duration
	// Coalesce is how long an open or write of a path by one process
	// stands for its repeats.
	Coalesce time.Duration
	// MaxBatch and MaxBatchBytes bound one Batch.
	MaxBatch      int
	MaxBatchBytes int
	// MaxProcs bounds the processes remembered; ExitGrace is how long an
	// exited one is (its events may still be queued).
	MaxProcs  int
	ExitGrace time.Duration
	// PendingWait is how long an event of a command whose id is not yet
	// known (see Monitor.Started) may wait for it.
	PendingWait time.Duration
	// DirCache bounds the directory paths remembered for directories
	// removed before their events are read.
	DirCache int
	Log      *slog.Logger
}

func (o Options) withDefaults() Options {
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	defDur := func(v *time.Duration, d time.Duration) {
		if *v <= 0 {
			*v = d
		}
	}
	if o.Root == "" {
		o.Root = DefaultRoot
	}
	def(&o.Self, os.Getpid())
	def(&o.Queue, DefaultQueue)
	def(&o.QueueBytes, DefaultQueueBytes)
	def(&o.MaxBatch, DefaultMaxBatch)
	def(&o.MaxBatchBytes, DefaultMaxBatchBytes)
	def(&o.MaxProcs, DefaultMaxProcs)
	def(&o.DirCache, DefaultDirCache)
	defDur(&o.FlushInterval, DefaultFlushInterval)
	defDur(&o.Coalesce, DefaultCoalesce)
	defDur(&o.ExitGrace, DefaultExitGrace)
	defDur(&o.PendingWait, DefaultPendingWait)
	if o.Log == nil {
		o.Log = slog.Default()
	}
	return o
}

// Monitor watches the workspace from Start until Close.
type Monitor struct {
	opts Options
	log  *slog.Logger
	g    *group
	conn *connector // nil without process events
	lin  *lineage
	q    *queue
	co   *coalescer

	closing atomic.Bool // Close has begun: the reader's failed read is no fault
	done    chan struct{}

	// The reader's own state.
	pending []Event // read, not yet attributed
	dropped uint64  // lost since the last flush
	buf     []byte

	closeOnce sync.Once
}

// Start starts watching. It fails if the kernel has no fanotify, the
// caller lacks CAP_SYS_ADMIN, or the root's file system cannot report
// file handles. Without the process events connector (CONFIG_PROC_EVENTS,
// CAP_NET_ADMIN) it still runs, attributing only live processes by their
// cgroups, and says so in the log; with neither it fails, since it could
// not tell the commands' events from any others.
func Start(opts Options) (*Monitor, error) {
	o := opts.withDefaults()
	root := o.Root
	if !strings.HasPrefix(root, "/") || len(root) > MaxPathBytes {
		return nil, fmt.Errorf("activity: root %q is not an absolute path", root)
	}
	g, err := openGroup(root, o.DirCache)
	if err != nil {
		return nil, err
	}
	conn, cerr := openConnector()
	if cerr != nil {
		if o.Cgroup == nil {
			g.close()
			return nil, fmt.Errorf("activity: no way to attribute events to commands: %w, and no cgroups", cerr)
		}
		o.Log.Warn("activity: no process events; only processes still running when their events are read are attributed", "err", cerr)
	}
	m := &Monitor{
		opts: o, log: o.Log.With("subsystem", "activity"), g: g, conn: conn,
		lin: newLineage(o.Self, o.Cgroup, o.MaxProcs, o.ExitGrace),
		q:   newQueue(o), co: newCoalescer(o.Coalesce),
		done: make(chan struct{}), buf: make([]byte, 64<<10),
	}
	go m.run()
	m.log.Info("watching the workspace", "root", root, "process_events", conn != nil, "cgroups", o.Cgroup != nil)
	return m, nil
}

// Started tells the monitor that the agent started a command, as pid, with
// the given id (exec.Runner.OnStart). It is safe on a nil Monitor.
func (m *Monitor) Started(pid int, id string) {
	if m == nil {
		return
	}
	m.lin.started(pid, id)
}

// Close stops the watch; a Serve running returns ErrClosed.
func (m *Monitor) Close() error {
	var err error
	m.closeOnce.Do(func() {
		// Closing the group ends the reader's wait; the rest it uses is
		// closed once it has returned.
		m.closing.Store(true)
		errs := []error{m.g.closeGroup()}
		<-m.done
		m.q.close()
		errs = append(errs, m.g.close())
		if m.conn != nil {
			errs = append(errs, m.conn.close())
		}
		err = errors.Join(errs...)
	})
	return err
}

// Serve sends batches to send until ctx ends, sending fails, a newer Serve
// starts (CodeAborted) or the monitor is closed (CodeUnavailable). A batch
// whose send fails is kept for the next Serve.
func (m *Monitor) Serve(ctx context.Context, send func(*agentv1.ActivityResponse) error) error {
	s := m.q.subscribe()
	defer m.q.unsubscribe(s)
	for {
		b, err := m.q.next(ctx, s)
		switch {
		case errors.Is(err, ErrSuperseded):
			return connect.NewError(connect.CodeAborted, err)
		case errors.Is(err, ErrClosed):
			return connect.NewError(connect.CodeUnavailable, err)
		case err != nil:
			return err
		}
		if err := send(Response(b, time.Now())); err != nil {
			m.q.requeue(b)
			return err
		}
	}
}

// Response is the message for a batch sent at now. Bytes of a path that
// are not UTF-8 become "?".
func Response(b Batch, now time.Time) *agentv1.ActivityResponse {
	msg := &agentv1.ActivityResponse{Dropped: b.Dropped, Events: make([]*agentv1.ActivityEvent, 0, len(b.Events))}
	for _, e := range b.Events {
		msg.Events = append(msg.Events, &agentv1.ActivityEvent{
			Op:     protoOps[e.Op],
			Path:   strings.ToValidUTF8(e.Path, "?"),
			Pid:    int32(e.Pid),
			ExecId: e.ExecID,
			AgeNs:  max(now.Sub(e.Time).Nanoseconds(), 0),
		})
	}
	return msg
}

// run is the reader: it waits for fanotify events, the flush timer or
// Close. Process events are not waited for: they are read before the
// fanotify events they attribute, and at each flush, so that a command's
// fork, exec and exit cost the guest one wake-up every FlushInterval, not
// three each (the socket's buffer holds far more than an interval's
// worth).
//
// It waits in the Go runtime's poller, with the flush as the read's
// deadline, not in a poll(2) of its own: a goroutine in a blocking system
// call holds the agent's one P (a one-vCPU guest) until the runtime's
// sysmon takes it back, up to a few milliseconds later (agent.slowSysmon),
// and every other goroutine waits meanwhile. That happened at every flush.
//
// The read returns to this loop only at the deadline, or when a wake-up
// read maxReads times and the group may hold more, so that flushing keeps
// its pace under a flood.
func (m *Monitor) run() {
	defer close(m.done)
	rc, err := m.g.f.SyscallConn()
	if err != nil {
		m.log.Error("activity: the watch has stopped", "err", err)
		return
	}
	next := time.Now().Add(m.opts.FlushInterval)
	_ = m.g.f.SetReadDeadline(next) // fails only once closed, as the read then does
	for {
		err := rc.Read(func(fd uintptr) bool { return m.read(int(fd), time.Now()) })
		if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
			if !m.closing.Load() {
				m.log.Error("activity: read; the watch has stopped", "err", err)
			}
			return
		}
		if now := time.Now(); !now.Before(next) {
			m.drainConnector()
			m.flush(now)
			next = now.Add(m.opts.FlushInterval)
			_ = m.g.f.SetReadDeadline(next)
		}
	}
}

func (m *Monitor) drainConnector() {
	if m.conn == nil {
		return
	}
	now := time.Now()
	if m.conn.drain(func(ev procEvent) { m.lin.event(ev, now) }) {
		m.log.Warn("activity: process events lost; the processes forked meanwhile are attributed by their cgroups while they run")
	}
}

// maxReads bounds the reads of one wake-up, so that flushing keeps its
// pace under a flood.
const maxReads = 16

// readMemo caches, for the events of one read, what is the same for all
// of them: directories' paths and processes' commands.
type readMemo struct {
	dirs  map[string]string
	procs map[int32]attribution
}

type attribution struct {
	id string
	v  verdict
}

// read reads the events queued in the fanotify group fd and keeps,
// pending, those of the commands' processes in the workspace. It reports
// whether the group may hold more: true when it read maxReads times
// without finding the group empty; false once a read found nothing (or
// failed), and the caller waits until the group is readable again.
func (m *Monitor) read(fd int, now time.Time) (more bool) {
	for range maxReads {
		n, err := unix.Read(fd, m.buf)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil || n <= 0 {
			return false // EAGAIN: all read
		}
		// The fork of every process in these events is queued by now:
		// read it before telling whose they are.
		m.drainConnector()
		memo := readMemo{dirs: map[string]string{}, procs: map[int32]attribution{}}
		err = parseEvents(m.buf[:n], func(ev rawEvent) { m.take(ev, now, memo) })
		if err != nil {
			m.dropped = addSat(m.dropped, 1)
			m.log.Warn("activity: skipped a malformed fanotify read", "bytes", n)
		}
	}
	return true
}

// take turns one raw event into Events, pending. The events of processes
// that are no command's are left before their paths are looked up.
func (m *Monitor) take(ev rawEvent, now time.Time, memo readMemo) {
	if ev.fd >= 0 {
		unix.Close(int(ev.fd))
	}
	if ev.mask&unix.FAN_Q_OVERFLOW != 0 {
		m.dropped = addSat(m.dropped, 1)
		return
	}
	if ev.pid <= 0 || int(ev.pid) == m.opts.Self {
		return
	}
	ops := opsOf(ev.mask)
	if len(ops) == 0 {
		return
	}
	who, ok := memo.procs[ev.pid]
	if !ok {
		who.id, who.v = m.lin.resolve(ev.pid)
		memo.procs[ev.pid] = who
	}
	if who.v == notOurs {
		return
	}
	p, ok := m.path(ev, memo.dirs)
	if !ok {
		m.dropped = addSat(m.dropped, uint64(len(ops)))
		return
	}
	if !under(p, m.opts.Root) {
		return // elsewhere on the file system
	}
	if ev.hasChild && ev.mask&unix.FAN_ONDIR != 0 && ev.mask&(unix.FAN_CREATE|unix.FAN_MOVED_TO) != 0 {
		// A directory made or moved here: remember where, in case it is
		// removed before the events of what is made in it are read.
		m.g.dirs.put(ev.child.key(), p)
	}
	for _, op := range ops {
		if len(m.pending) >= m.opts.Queue {
			m.dropped = addSat(m.dropped, 1)
			continue
		}
		m.pending = append(m.pending, Event{Op: op, Path: p, Pid: int(ev.pid), ExecID: who.id, Time: now})
	}
}

// path is the event's object's path: its directory's path and its name.
func (m *Monitor) path(ev rawEvent, memo map[string]string) (string, bool) {
	if !ev.hasDir || !ev.hasName {
		return "", false // an unlinked file's write: there is no name
	}
	k := ev.dir.key()
	dir, ok := memo[k]
	if !ok {
		if dir, ok = m.g.dirPath(ev.dir); !ok {
			return "", false
		}
		memo[k] = dir
	}
	p := dir
	if ev.name != "." {
		if dir == "/" {
			p = "/" + ev.name
		} else {
			p = dir + "/" + ev.name
		}
	}
	if len(p) > MaxPathBytes {
		return "", false
	}
	return p, true
}

// flush queues the pending events whose command is known, merging
// repeats. Those of a command whose id has yet to come wait for it, up to
// PendingWait.
func (m *Monitor) flush(now time.Time) {
	m.drainConnector()
	var out []Event
	keep := m.pending[:0]
	for _, e := range m.pending {
		v := ours
		if e.ExecID == "" {
			e.ExecID, v = m.lin.resolve(int32(e.Pid))
		}
		switch v {
		case ours:
			if m.co.keep(e) {
				out = append(out, e)
			}
		case pendingID:
			if now.Sub(e.Time) < m.opts.PendingWait {
				keep = append(keep, e)
			} else {
				m.dropped = addSat(m.dropped, 1)
			}
		}
	}
	clear(m.pending[len(keep):])
	m.pending = keep
	m.q.push(out, m.dropped)
	m.dropped = 0
	m.co.prune(now)
	m.lin.prune(now)
}

// under reports whether p is root or below it.
func under(p, root string) bool {
	return p == root || root == "/" || strings.HasPrefix(p, root+"/")
}
