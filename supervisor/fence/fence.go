// Package fence keeps a fleet host from running an agent that its fleet
// engine may have started elsewhere. The engine hears from the host by
// its lease renewals; carreld hears of each one from its node helper
// (cmd/carrel-node), which renews only while carreld answers it. Once
// the engine has gone unheard for After, every fleet VM (one labelled
// with a run) is stopped by force, and until it is heard again no call
// may act on one, except to read, stop or delete it. The check is made
// on each call, by the clock, so it holds the moment the time is up,
// even before the stop, and even after carreld itself was frozen.
//
// The engine declares the host lost only after a longer timeout; the
// difference is the time the stop may take.
package fence

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// LabelRun marks a fleet VM: its value is the run's id.
const LabelRun = "carrel.dev/run"

// ErrFenced refuses a call to a fleet VM of a fenced host.
var ErrFenced = errors.New("this host's fleet engine has not heard from it in time, so its fleet VMs are fenced: the engine may run their agents on another host now")

// ErrEngineOwned refuses starting a fleet VM again: a run ends once.
var ErrEngineOwned = errors.New("this VM is a fleet run's, which ends once: the fleet engine starts a new run instead")

// Config configures a Fence.
type Config struct {
	// After is how long the engine may go unheard.
	After time.Duration
	// Labels returns a VM's labels (nil for no such VM).
	Labels func(vm string) map[string]string
	// Fleet lists the fleet VMs that run.
	Fleet func() []string
	// Stop stops a VM by force.
	Stop func(ctx context.Context, vm string) error
	Log  *slog.Logger
}

// Fence is one host's fence.
type Fence struct {
	cfg   Config
	mu    sync.Mutex
	heard time.Time // by the monotonic clock
	// fenced is set from when the time ran out until the engine is heard
	// again; the VMs it stopped stay stopped.
	fenced bool
}

// New returns a Fence that counts as just heard.
func New(cfg Config) *Fence {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	return &Fence{cfg: cfg, heard: time.Now()}
}

// Heard says that a renewal that began at t succeeded.
func (f *Fence) Heard(t time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if t.After(f.heard) {
		f.heard = t
	}
	if f.fenced && time.Since(f.heard) < f.cfg.After {
		f.fenced = false
		f.cfg.Log.Info("fleet engine heard again: fleet VMs may be called again")
	}
}

// Fenced reports whether the engine has gone unheard for After.
func (f *Fence) Fenced() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.fenced || time.Since(f.heard) >= f.cfg.After
}

// startProcedures start or resume a VM: a fleet VM is never started again.
var startProcedures = map[string]bool{
	"/carrel.api.v1.VMService/StartVM":  true,
	"/carrel.api.v1.VMService/ResumeVM": true,
	"/carrel.api.v1.VMService/ResetVM":  true,
}

// Guard refuses a call to act on vm (not to read, stop or delete it,
// which the API never asks about) while the host is fenced and vm is a
// fleet VM, and a call to start a fleet VM again at any time.
func (f *Fence) Guard(procedure, vm string) error {
	start := startProcedures[procedure]
	if !start && !f.Fenced() {
		return nil
	}
	if f.cfg.Labels(vm)[LabelRun] == "" {
		return nil
	}
	if start {
		return ErrEngineOwned
	}
	return ErrFenced
}

// Watch fences the host when its time is up, checking every tick.
func (f *Fence) Watch(ctx context.Context, tick time.Duration) {
	t := time.NewTicker(tick)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			f.check(ctx)
		}
	}
}

func (f *Fence) check(ctx context.Context) {
	f.mu.Lock()
	unheard := time.Since(f.heard)
	due := unheard >= f.cfg.After
	first := due && !f.fenced
	if due {
		f.fenced = true
	}
	f.mu.Unlock()
	if !due {
		return
	}
	vms := f.cfg.Fleet()
	if first || len(vms) > 0 {
		f.cfg.Log.Warn("fleet engine unheard: fencing the fleet VMs", "unheard", unheard.Round(time.Millisecond), "after", f.cfg.After, "vms", vms)
	}
	for _, vm := range vms {
		if err := f.cfg.Stop(ctx, vm); err != nil {
			f.cfg.Log.Error("fence: VM not stopped", "vm", vm, "err", err)
		}
	}
}

// Monotonic is CLOCK_MONOTONIC in nanoseconds: one clock for every
// process of the host.
func Monotonic() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		panic(err) // Linux always has it
	}
	return ts.Nano()
}

// maxReport caps one report line.
const maxReport = 64

// Report formats a renewal report: it began at mono (Monotonic).
func Report(mono int64) string { return "heard " + strconv.FormatInt(mono, 10) + "\n" }

// ReadReports reads the helper's renewal reports from r until it ends.
// A report must be of the past minute by the host's monotonic clock.
func (f *Fence) ReadReports(r io.Reader) error {
	s := bufio.NewScanner(r)
	s.Buffer(make([]byte, maxReport), maxReport)
	for s.Scan() {
		t, err := parseReport(s.Text(), Monotonic(), time.Now())
		if err != nil {
			return err
		}
		f.Heard(t)
	}
	return s.Err()
}

// parseReport turns a report into a time by the local clock, given the
// monotonic clock and the wall clock read together.
func parseReport(line string, nowMono int64, now time.Time) (time.Time, error) {
	v, ok := strings.CutPrefix(line, "heard ")
	if !ok {
		return time.Time{}, fmt.Errorf("fleet helper: bad report %.64q", line)
	}
	mono, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return time.Time{}, fmt.Errorf("fleet helper: bad report %.64q", line)
	}
	age := time.Duration(nowMono - mono)
	if age < 0 || age > time.Minute {
		return time.Time{}, fmt.Errorf("fleet helper: report of %s ago is out of range", age)
	}
	return now.Add(-age), nil
}
