package main

import (
	"errors"
	"testing"
	"time"

	"connectrpc.com/connect"
)

func TestAdoptionsCountsEachVMsLogLines(t *testing.T) {
	logs := `time=2026-11-26T23:44:31.001Z level=INFO msg="adopted running vm" subsystem=vm vm=soak0 pid=101
time=2026-11-26T23:44:31.002Z level=WARN msg="adopted vm's agent is not answering" subsystem=vm vm=soak1 err=x
time=2026-11-26T23:44:31.003Z level=INFO msg="adopted running vm" subsystem=vm vm=soak1 pid=102
time=2026-11-26T23:48:31.003Z level=INFO msg="adopted running vm" subsystem=vm vm=soak1 pid=102
`
	got := adoptions(logs)
	if len(got) != 2 || got["soak0"] != 1 || got["soak1"] != 2 {
		t.Errorf("adoptions = %v, want soak0:1 soak1:2", got)
	}
}

// A window excuses a VM's clear errors that overlap it, and nothing else.
func TestFailuresExcuseOnlyClearErrorsInTheirWindow(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	unavailable := connect.NewError(connect.CodeUnavailable, errors.New("dial unix api.sock: connection refused"))
	w := []window{{vm: 1, from: t0.Add(10 * time.Second), to: t0.Add(20 * time.Second)}}
	samples := []sample{
		{at: t0.Add(5 * time.Second), lat: 6 * time.Second, vm: 1, err: unavailable},  // ends inside: excused
		{at: t0.Add(15 * time.Second), lat: time.Second, vm: 1, err: unavailable},     // inside: excused
		{at: t0.Add(15 * time.Second), lat: time.Second, vm: 0, err: unavailable},     // another VM
		{at: t0.Add(21 * time.Second), lat: time.Second, vm: 1, err: unavailable},     // after
		{at: t0.Add(15 * time.Second), lat: time.Second, vm: 1, err: errors.New("x")}, // not a connect error
		{at: t0.Add(15 * time.Second), lat: time.Second, vm: 1, err: connect.NewError(connect.CodeUnknown, errors.New("y"))},
		{at: t0.Add(15 * time.Second), lat: time.Second, vm: 1}, // no error
	}
	excused, bad := failures(samples, w)
	if len(excused) != 2 || len(bad) != 4 {
		t.Errorf("excused %d, bad %d; want 2 and 4", len(excused), len(bad))
	}
	// A window for every VM.
	w[0].vm = -1
	if excused, _ := failures(samples[:3], w); len(excused) != 3 {
		t.Errorf("a window for all VMs excused %d of 3", len(excused))
	}
}

func TestWithinTolerance(t *testing.T) {
	for _, c := range []struct {
		before, after float64
		want          bool
	}{{100, 110, true}, {100, 111, false}, {100, 50, true}, {0, 0, true}} {
		if got := within(c.before, c.after); got != c.want {
			t.Errorf("within(%v, %v) = %v", c.before, c.after, got)
		}
	}
}
