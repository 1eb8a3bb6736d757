//go:build linux

package agent

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"
)

// sysmonSlack is the timer slack the agent gives the Go runtime's sysmon
// thread.
//
// Why. While a goroutine is in a system call, sysmon wakes every 20 µs
// (usleep, with the thread's timer slack, 50 µs by default) to see
// whether it should hand the P to another thread; with GOMAXPROCS at 1, as
// in a one-vCPU guest, it does so for nearly every call that outlasts one
// look. Under emulation almost every call does, and every look costs the
// guest a timer interrupt and two thread switches, and every hand-over a
// third thread woken. Counted in the guest over 200 execs of `true`,
// sysmon woke 27-33 times per exec, with 28-34 timer interrupts and 81-94
// context switches in all. With a slack of 1 ms: 12, 13 and 56, and the
// guest's vCPU time per exec fell by about an eighth against qemu-ga's in
// the same runs (a Files.Stat round trip's by a third). With 4 ms, once
// the activity monitor no longer waited in a blocking poll(2) that
// sysmon had to take the P back from at every flush, it fell by about
// another 5% (a Files.Stat's by about 10%); see "The runtime's sysmon
// thread" in docs/architecture.md.
//
// The cost is that sysmon's looks come up to this much later: a P held by
// a goroutine in a long system call (a file's fsync) passes to waiting
// goroutines up to 4 ms later, and a goroutine that runs past its 10 ms
// slice is preempted up to 4 ms later. The runtime may clone new threads
// from sysmon, which then inherit the slack, so some of the agent's timers
// may fire up to 4 ms late too; none of them needs finer (the shortest,
// protocol.EventHold, only holds a young command's first events back).
// Commands never inherit it: the thread that forks them resets its own
// slack first (sandbox.Spawn).
const sysmonSlack = 4 * time.Millisecond

// slowSysmon gives the runtime's sysmon thread sysmonSlack. It must run
// where the agent serves, never before an exec of another init: the slack
// would carry over to it and to every process it starts.
//
// The runtime starts sysmon as the process's first thread after the main
// one, before any package is initialised (runtime.main), and thread ids
// are handed out in increasing order (until they wrap at pid_max, which a
// booting guest is far from), so sysmon is the lowest id in
// /proc/self/task other than the process's own. Were it another thread,
// that thread would get the slack instead, and nothing but the gain would
// be lost. Writing another thread's
// slack (/proc/TID/timerslack_ns) needs CAP_SYS_NICE, which the agent has
// as root; without it the agent goes on as before.
func slowSysmon() (tid int, err error) {
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return 0, err
	}
	ids := make([]int, 0, len(tasks))
	for _, t := range tasks {
		if id, err := strconv.Atoi(t.Name()); err == nil {
			ids = append(ids, id)
		}
	}
	tid = sysmonTID(os.Getpid(), ids)
	if tid == 0 {
		return 0, errors.New("no thread besides the main one")
	}
	ns := strconv.FormatInt(sysmonSlack.Nanoseconds(), 10)
	if err := os.WriteFile(fmt.Sprintf("/proc/%d/timerslack_ns", tid), []byte(ns), 0); err != nil {
		return tid, err
	}
	return tid, nil
}

// sysmonTID picks sysmon's thread among the process's thread ids: the
// lowest that is not pid, the main thread's; 0 if there is none.
func sysmonTID(pid int, tids []int) int {
	lowest := 0
	for _, id := range tids {
		if id != pid && id > 0 && (lowest == 0 || id < lowest) {
			lowest = id
		}
	}
	return lowest
}
