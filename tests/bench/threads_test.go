package main

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// fakeTask writes one thread's comm and schedstat under proc.
func fakeTask(t *testing.T, proc string, pid, tid int, comm, schedstat string) {
	t.Helper()
	dir := filepath.Join(proc, itoa(pid), "task", itoa(tid))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, s := range map[string]string{"comm": comm + "\n", "schedstat": schedstat + "\n"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func itoa(n int) string { return strconv.Itoa(n) }

// TestReadQEMUThreads: the main loop is the process's own thread, the
// vCPUs are summed, and other threads (workers, the monitor's) are left
// out.
func TestReadQEMUThreads(t *testing.T) {
	proc := t.TempDir()
	fakeTask(t, proc, 100, 100, "qemu-system-x86", "5000000 2000000 30")
	fakeTask(t, proc, 100, 101, "worker", "900000000 0 9")
	fakeTask(t, proc, 100, 102, "CPU 0/TCG", "7000000 1000000 40")
	fakeTask(t, proc, 100, 103, "CPU 1/TCG", "3000000 500000 10")
	fakeTask(t, proc, 100, 104, "IO mon_iothread", "800000000 0 8")
	q, err := readQEMUThreads(proc, 100)
	if err != nil {
		t.Fatal(err)
	}
	want := qemuThreads{
		main:  threadTimes{run: 5 * time.Millisecond, wait: 2 * time.Millisecond, switches: 30},
		vcpus: threadTimes{run: 10 * time.Millisecond, wait: 1500 * time.Microsecond, switches: 50},
	}
	if q != want {
		t.Errorf("got %+v, want %+v", q, want)
	}
	if d := q.sub(want); d != (qemuThreads{}) {
		t.Errorf("a reading less itself is %+v", d)
	}
}

func TestReadQEMUThreadsWithoutVCPUs(t *testing.T) {
	proc := t.TempDir()
	fakeTask(t, proc, 7, 7, "qemu-system-x86", "1 2 3")
	fakeTask(t, proc, 7, 8, "qemu-system-x86", "1 2 3") // no debug-threads=on
	if _, err := readQEMUThreads(proc, 7); err == nil {
		t.Error("no error for a QEMU whose vCPU threads cannot be told apart")
	}
}

func TestParseSchedstat(t *testing.T) {
	for _, bad := range []string{"", "1 2", "1 2 3 4", "1 x 3", "-1 2 3"} {
		if _, err := parseSchedstat(bad); err == nil {
			t.Errorf("parseSchedstat(%q): no error", bad)
		}
	}
	got, err := parseSchedstat("12 34 56\n")
	if err != nil || got != (threadTimes{run: 12, wait: 34, switches: 56}) {
		t.Errorf("got %+v, %v", got, err)
	}
}

// TestThreadWatchMedian: each figure's median over the transfers, and a
// nil watch only runs the transfer.
func TestThreadWatchMedian(t *testing.T) {
	w := threadWatch{runs: []qemuThreads{
		{main: threadTimes{run: 3, wait: 30, switches: 300}},
		{main: threadTimes{run: 1, wait: 10, switches: 100}},
		{main: threadTimes{run: 2, wait: 20, switches: 200}},
	}}
	if got := w.median().main; got != (threadTimes{run: 2, wait: 20, switches: 200}) {
		t.Errorf("median %+v", got)
	}
	ran := false
	var nilWatch *threadWatch
	if err := nilWatch.around(func() error { ran = true; return nil }); err != nil || !ran {
		t.Errorf("nil watch: ran %v, err %v", ran, err)
	}
}
