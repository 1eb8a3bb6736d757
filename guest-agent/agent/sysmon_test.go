//go:build linux

package agent

import (
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestSysmonTID(t *testing.T) {
	for _, c := range []struct {
		pid  int
		tids []int
		want int
	}{
		{1, []int{1, 79, 80, 81, 99}, 79},
		{1, []int{99, 81, 1, 80, 79}, 79}, // in any order
		{500, []int{500, 501, 502}, 501},
		{500, []int{500}, 0}, // the main thread alone
		{500, nil, 0},
		{500, []int{0, -3, 500, 7}, 7}, // not thread ids
	} {
		if got := sysmonTID(c.pid, c.tids); got != c.want {
			t.Errorf("sysmonTID(%d, %v) = %d, want %d", c.pid, c.tids, got, c.want)
		}
	}
}

// TestSlowSysmon: on this test's own process, the thread slowSysmon picks
// is one of the process's, not the main one, and gets sysmonSlack, while
// the main thread keeps its slack.
func TestSlowSysmon(t *testing.T) {
	read := func(tid int) string {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(tid) + "/timerslack_ns")
		if err != nil {
			t.Skipf("no timer slack to read: %v", err)
		}
		return strings.TrimSpace(string(b))
	}
	mainSlack := read(os.Getpid())
	tid, err := slowSysmon()
	if err != nil {
		t.Skipf("cannot set another thread's timer slack (needs CAP_SYS_NICE): %v", err)
	}
	t.Cleanup(func() { os.WriteFile("/proc/"+strconv.Itoa(tid)+"/timerslack_ns", []byte("0"), 0) })
	if tid == os.Getpid() {
		t.Fatalf("slowSysmon picked the main thread")
	}
	if _, err := os.Stat("/proc/self/task/" + strconv.Itoa(tid)); err != nil {
		t.Fatalf("slowSysmon picked %d, not a thread of this process: %v", tid, err)
	}
	if got, want := read(tid), strconv.FormatInt(sysmonSlack.Nanoseconds(), 10); got != want {
		t.Errorf("thread %d's timer slack is %s, want %s", tid, got, want)
	}
	if got := read(os.Getpid()); got != mainSlack {
		t.Errorf("the main thread's timer slack changed from %s to %s", mainSlack, got)
	}
	// It is sysmon: while a goroutine runs, sysmon sleeps between its
	// looks in usleep, which is nanosleep (35 on amd64), where no other
	// thread of the runtime sleeps.
	if runtime.GOARCH != "amd64" {
		return
	}
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
		}
	}()
	path := "/proc/self/task/" + strconv.Itoa(tid) + "/syscall"
	var last string
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatalf("thread %d: %v", tid, err)
		}
		if last = string(b); strings.HasPrefix(last, "35 ") {
			return
		}
	}
	t.Errorf("thread %d was never seen in nanosleep, as sysmon is between its looks; last in %q", tid, last)
}
