package main

import (
	"cmp"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// threadTimes is what the scheduler says of a thread, from its
// /proc/PID/task/TID/schedstat: time on a CPU, time runnable but waiting
// for one, and how many times it was put on a CPU.
type threadTimes struct {
	run, wait time.Duration
	switches  int64
}

func (t threadTimes) sub(u threadTimes) threadTimes {
	return threadTimes{run: t.run - u.run, wait: t.wait - u.wait, switches: t.switches - u.switches}
}

func (t threadTimes) String() string {
	return fmt.Sprintf("%4d ms on a CPU, %4d ms waiting for one, %5d switches in", t.run.Milliseconds(), t.wait.Milliseconds(), t.switches)
}

// qemuThreads is the scheduler's account of the two QEMU threads that move
// a virtio-serial port's bytes: the main loop (the process's first thread),
// which carries them between the host socket and the guest's queue, and
// the vCPUs, whose guest reads and writes them (threads named "CPU n/..."
// by -name ...,debug-threads=on, as carrel's drivers start QEMU).
type qemuThreads struct{ main, vcpus threadTimes }

func (q qemuThreads) sub(p qemuThreads) qemuThreads {
	return qemuThreads{main: q.main.sub(p.main), vcpus: q.vcpus.sub(p.vcpus)}
}

// readQEMUThreads reads qemuThreads for process pid under proc (/proc).
func readQEMUThreads(proc string, pid int) (qemuThreads, error) {
	var q qemuThreads
	tasks, err := os.ReadDir(filepath.Join(proc, strconv.Itoa(pid), "task"))
	if err != nil {
		return q, err
	}
	vcpus := 0
	for _, task := range tasks {
		dir := filepath.Join(proc, strconv.Itoa(pid), "task", task.Name())
		comm, err := os.ReadFile(filepath.Join(dir, "comm"))
		if err != nil {
			continue // the thread has ended
		}
		isMain, isVCPU := task.Name() == strconv.Itoa(pid), strings.HasPrefix(string(comm), "CPU ")
		if !isMain && !isVCPU {
			continue
		}
		st, err := os.ReadFile(filepath.Join(dir, "schedstat"))
		if err != nil {
			continue
		}
		t, err := parseSchedstat(string(st))
		if err != nil {
			return q, fmt.Errorf("%s: %w", dir, err)
		}
		if isMain {
			q.main = t
			continue
		}
		vcpus++
		q.vcpus.run, q.vcpus.wait, q.vcpus.switches = q.vcpus.run+t.run, q.vcpus.wait+t.wait, q.vcpus.switches+t.switches
	}
	if vcpus == 0 {
		return q, fmt.Errorf("no vCPU thread in QEMU %d (is it started with debug-threads=on?)", pid)
	}
	return q, nil
}

// parseSchedstat reads schedstat's three numbers: ns on a CPU, ns
// waiting on a run queue, and timeslices run.
func parseSchedstat(s string) (threadTimes, error) {
	f := strings.Fields(s)
	if len(f) != 3 {
		return threadTimes{}, fmt.Errorf("schedstat %q: want 3 fields", s)
	}
	var v [3]int64
	for i, x := range f {
		n, err := strconv.ParseInt(x, 10, 64)
		if err != nil || n < 0 {
			return threadTimes{}, fmt.Errorf("schedstat %q: bad field %q", s, x)
		}
		v[i] = n
	}
	return threadTimes{run: time.Duration(v[0]), wait: time.Duration(v[1]), switches: v[2]}, nil
}

// threadWatch records what QEMU's threads did during each of a series of
// transfers, for a median over rounds.
type threadWatch struct {
	pid  int
	runs []qemuThreads
	err  error // the first failure to read; the figures are then left out
}

// around runs f and records what QEMU's threads did meanwhile; a nil w
// only runs f.
func (w *threadWatch) around(f func() error) error {
	if w == nil {
		return f()
	}
	before, berr := readQEMUThreads("/proc", w.pid)
	if err := f(); err != nil {
		return err
	}
	after, aerr := readQEMUThreads("/proc", w.pid)
	if err := cmp.Or(berr, aerr); err != nil {
		if w.err == nil {
			w.err = err
		}
		return nil
	}
	w.runs = append(w.runs, after.sub(before))
	return nil
}

// median is the median of each figure over the recorded transfers.
func (w *threadWatch) median() qemuThreads {
	mains, vcpus := make([]threadTimes, len(w.runs)), make([]threadTimes, len(w.runs))
	for i, r := range w.runs {
		mains[i], vcpus[i] = r.main, r.vcpus
	}
	return qemuThreads{main: medianTimes(mains), vcpus: medianTimes(vcpus)}
}

// medianTimes is the median of each of ts's three figures on its own.
func medianTimes(ts []threadTimes) threadTimes {
	run, wait, switches := make([]time.Duration, len(ts)), make([]time.Duration, len(ts)), make([]time.Duration, len(ts))
	for i, t := range ts {
		run[i], wait[i], switches[i] = t.run, t.wait, time.Duration(t.switches)
	}
	return threadTimes{run: median(run), wait: median(wait), switches: int64(median(switches))}
}
