//go:build linux

package activity

import (
	"context"
	"errors"
	"testing"
	"time"
)

const self = 1

func fork(l *lineage, parent, child int32, now time.Time) {
	l.event(procEvent{fork: true, parentTgid: parent, pid: child, tgid: child}, now)
}

func exit(l *lineage, pid int32, now time.Time) {
	l.event(procEvent{pid: pid, tgid: pid}, now)
}

func wantVerdict(t *testing.T, l *lineage, pid int32, id string, v verdict) {
	t.Helper()
	gotID, got := l.resolve(pid)
	if got != v || gotID != id {
		t.Errorf("resolve(%d) = %q, %d; want %q, %d", pid, gotID, got, id, v)
	}
}

// TestLineageFollowsDescendants: a command's children and grandchildren
// are its own, after they exit too (for the grace), and after their parent
// has gone.
func TestLineageFollowsDescendants(t *testing.T) {
	now := time.Now()
	l := newLineage(self, nil, 100, 10*time.Second)
	fork(l, self, 100, now)
	l.started(100, "A")
	fork(l, 100, 101, now)
	fork(l, 101, 102, now)
	fork(l, 50, 60, now) // a process that is no command's
	exit(l, 101, now)
	exit(l, 102, now)
	wantVerdict(t, l, 100, "A", ours)
	wantVerdict(t, l, 101, "A", ours)
	wantVerdict(t, l, 102, "A", ours)
	wantVerdict(t, l, 60, "", notOurs)
	wantVerdict(t, l, self, "", notOurs)
	wantVerdict(t, l, 999, "", notOurs)
	// A thread is not a process.
	l.event(procEvent{fork: true, parentTgid: 100, pid: 103, tgid: 100}, now)
	wantVerdict(t, l, 103, "", notOurs)

	l.prune(now.Add(11 * time.Second))
	wantVerdict(t, l, 101, "", notOurs)
	wantVerdict(t, l, 100, "A", ours) // still running
	if n := l.size(); n != 1 {
		t.Errorf("%d processes remembered, want 1", n)
	}
}

// TestLineageWaitsForTheID: a command's events may be read before Started
// brings its id; its descendants' too. Started may also come first.
func TestLineageWaitsForTheID(t *testing.T) {
	now := time.Now()
	l := newLineage(self, nil, 100, time.Second)
	fork(l, self, 200, now)
	fork(l, 200, 201, now)
	wantVerdict(t, l, 201, "", pendingID)
	l.started(200, "B")
	wantVerdict(t, l, 201, "B", ours)

	l.started(300, "C")
	fork(l, self, 300, now) // read after Started
	wantVerdict(t, l, 300, "C", ours)
}

// TestLineagePidReuse: a pid that a command's process had, then another
// process gets, is no longer the command's.
func TestLineagePidReuse(t *testing.T) {
	now := time.Now()
	l := newLineage(self, nil, 100, time.Minute)
	l.started(100, "A")
	fork(l, 100, 101, now)
	exit(l, 101, now)
	fork(l, 50, 101, now) // 101 again, not ours
	wantVerdict(t, l, 101, "", notOurs)
	exit(l, 100, now)
	l.started(100, "D") // a new command with the pid of an old one
	wantVerdict(t, l, 100, "D", ours)
}

// TestLineageBounded: past its cap, lineage forgets exited processes to
// make room, then stops recording (counted), and falls back to cgroups.
func TestLineageBounded(t *testing.T) {
	now := time.Now()
	groups := map[int]string{400: "E"}
	l := newLineage(self, func(pid int) (string, bool) { id, ok := groups[pid]; return id, ok }, 3, time.Minute)
	l.started(100, "A")
	fork(l, 100, 101, now)
	fork(l, 100, 102, now)
	exit(l, 101, now)
	fork(l, 100, 103, now) // 101 makes room
	wantVerdict(t, l, 103, "A", ours)
	fork(l, 100, 104, now) // no room
	if l.untracked != 1 {
		t.Errorf("untracked %d, want 1", l.untracked)
	}
	wantVerdict(t, l, 104, "", notOurs)
	wantVerdict(t, l, 400, "E", ours) // by its cgroup
	// A fork from an unknown parent in a command's group.
	fork(l, 400, 401, now)
	wantVerdict(t, l, 401, "", notOurs) // no room for it
}

func TestCoalescer(t *testing.T) {
	now := time.Now()
	c := newCoalescer(100 * time.Millisecond)
	e := func(op Op, p string, pid int, d time.Duration) Event {
		return Event{Op: op, Path: p, Pid: pid, Time: now.Add(d)}
	}
	steps := []struct {
		ev   Event
		keep bool
	}{
		{e(Modify, "/w/a", 7, 0), true},
		{e(Modify, "/w/a", 7, 50*time.Millisecond), false},
		{e(Modify, "/w/a", 8, 60*time.Millisecond), true}, // another process
		{e(Modify, "/w/a", 8, 70*time.Millisecond), false},
		{e(Open, "/w/a", 8, 70*time.Millisecond), true}, // another op
		{e(Modify, "/w/a", 7, 150*time.Millisecond), true},
		{e(Delete, "/w/a", 7, 151*time.Millisecond), true},
		{e(Delete, "/w/a", 7, 152*time.Millisecond), true}, // never merged
		{e(Modify, "/w/a", 7, 160*time.Millisecond), true}, // a new file
	}
	for i, s := range steps {
		if got := c.keep(s.ev); got != s.keep {
			t.Errorf("step %d (%v %s by %d): keep %v, want %v", i, s.ev.Op, s.ev.Path, s.ev.Pid, got, s.keep)
		}
	}
	c.prune(now.Add(time.Second))
	if len(c.last) != 0 {
		t.Errorf("%d marks left after the window", len(c.last))
	}
}

func TestQueueBoundsAndBatches(t *testing.T) {
	q := newQueue(Options{Queue: 4, QueueBytes: 1 << 20, MaxBatch: 3, MaxBatchBytes: 1 << 20})
	var evs []Event
	for i := range 6 {
		evs = append(evs, Event{Op: Create, Path: "/w/" + string(rune('a'+i)), Pid: 1, ExecID: "x"})
	}
	q.push(evs, 5)
	s := q.subscribe()
	b, err := q.next(context.Background(), s)
	if err != nil {
		t.Fatal(err)
	}
	if len(b.Events) != 3 || b.Dropped != 5+2 || b.Events[0].Path != "/w/a" {
		t.Fatalf("first batch: %d events, dropped %d", len(b.Events), b.Dropped)
	}
	// Not sent: back in front, and the count with it.
	q.requeue(b)
	b, _ = q.next(context.Background(), s)
	if len(b.Events) != 3 || b.Dropped != 7 || b.Events[0].Path != "/w/a" {
		t.Fatalf("batch after requeue: %d events, dropped %d, first %s", len(b.Events), b.Dropped, b.Events[0].Path)
	}
	b, _ = q.next(context.Background(), s)
	if len(b.Events) != 1 || b.Events[0].Path != "/w/d" || b.Dropped != 0 {
		t.Fatalf("last batch: %+v", b)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := q.next(ctx, s); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("next on an empty queue: %v", err)
	}

	// A newer subscriber ends the older one's wait.
	waiting := make(chan struct{}, 1)
	q.mu.Lock()
	q.waiting = func() { waiting <- struct{}{} }
	q.mu.Unlock()
	done := make(chan error, 1)
	go func() { _, err := q.next(context.Background(), s); done <- err }()
	<-waiting
	q.subscribe()
	if err := <-done; !errors.Is(err, ErrSuperseded) {
		t.Errorf("older subscriber: %v, want ErrSuperseded", err)
	}
}

func TestQueueByteBound(t *testing.T) {
	q := newQueue(Options{Queue: 100, QueueBytes: 3 * eventBytes(Event{Path: "/w/x"}), MaxBatch: 100, MaxBatchBytes: 2 * eventBytes(Event{Path: "/w/x"})})
	evs := []Event{{Path: "/w/1"}, {Path: "/w/2"}, {Path: "/w/3"}, {Path: "/w/4"}}
	q.push(evs, 0)
	s := q.subscribe()
	b, _ := q.next(context.Background(), s)
	if len(b.Events) != 2 || b.Dropped != 1 {
		t.Errorf("batch: %d events, dropped %d; want 2 (the batch's bytes) and 1 (the queue's)", len(b.Events), b.Dropped)
	}
}
