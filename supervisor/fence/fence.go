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
// difference is the time the stop may take. Time is CLOCK_BOOTTIME, which
// goes on while the host is suspended, and the last renewal heard is kept
// in a file, so that neither a suspend nor a restart of carreld (whose
// VMs run on meanwhile) gives the fleet VMs time they did not have.
package fence

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/supervisor/atomicfile"
)

// LabelRun marks a fleet VM: its value is the run's id.
const LabelRun = "carrel.dev/run"

// ErrFenced refuses a call to a fleet VM of a fenced host.
var ErrFenced = errors.New("this host's fleet engine has not heard from it in time, so its fleet VMs are fenced: the engine may run their agents on another host now")

// ErrEngineOwned refuses starting, restoring or forking a fleet VM: a
// run ends once, and the engine starts a new run instead.
var ErrEngineOwned = errors.New("this VM is a fleet run's, which ends once and is not copied: the fleet engine starts a new run instead")

// Config configures a Fence.
type Config struct {
	// After is how long the engine may go unheard.
	After time.Duration
	// State keeps the last renewal heard across restarts ("": none).
	State string
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
	heard int64 // CLOCK_BOOTTIME, ns
	boot  string
	// fenced is set from when the time ran out until the engine is heard
	// again; the VMs it stopped stay stopped.
	fenced bool
}

// New returns a Fence. It counts as just heard unless State says when
// it last heard, in this boot of the host: a carreld restarted after its
// time ran out starts fenced (Check stops its fleet VMs).
func New(cfg Config) *Fence {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	f := &Fence{cfg: cfg, heard: Boottime(), boot: bootID()}
	if cfg.State == "" {
		return f
	}
	b, err := os.ReadFile(cfg.State)
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			cfg.Log.Warn("fence state unreadable: counting the engine as just heard", "file", cfg.State, "err", err)
		}
		return f
	}
	boot, v, _ := strings.Cut(strings.TrimSpace(string(b)), " ")
	t, err := strconv.ParseInt(v, 10, 64)
	if err == nil && boot == f.boot && boot != "" && t <= f.heard {
		f.heard = t
		if f.fencedLocked() {
			cfg.Log.Warn("the fleet engine went unheard while carreld was down: the fleet VMs are fenced", "unheard", time.Duration(Boottime()-t).Round(time.Millisecond))
		}
	}
	return f
}

// Heard says that a renewal that began at t (Boottime) succeeded.
func (f *Fence) Heard(t int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if t <= f.heard {
		return
	}
	f.heard = t
	if f.cfg.State != "" {
		if err := atomicfile.WriteFile(f.cfg.State, []byte(f.boot+" "+strconv.FormatInt(t, 10)+"\n"), 0o600); err != nil {
			f.cfg.Log.Warn("fence state not kept", "file", f.cfg.State, "err", err)
		}
	}
	if f.fenced && time.Duration(Boottime()-f.heard) < f.cfg.After {
		f.fenced = false
		f.cfg.Log.Info("fleet engine heard again: fleet VMs may be called again")
	}
}

// Fenced reports whether the engine has gone unheard for After.
func (f *Fence) Fenced() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.fencedLocked()
}

func (f *Fence) fencedLocked() bool {
	return f.fenced || time.Duration(Boottime()-f.heard) >= f.cfg.After
}

// startProcedures would run a fleet VM again, or its state as another
// VM: a run ends once, and its state stays with it.
var startProcedures = map[string]bool{
	"/carrel.api.v1.VMService/StartVM":   true,
	"/carrel.api.v1.VMService/ResumeVM":  true,
	"/carrel.api.v1.VMService/ResetVM":   true,
	"/carrel.api.v1.VMService/RestoreVM": true,
	"/carrel.api.v1.VMService/ForkVM":    true,
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
			f.Check(ctx)
		}
	}
}

// stopTimeout bounds one fence stop; a VM still running is stopped
// again at the next check.
const stopTimeout = 10 * time.Second

// Check stops every running fleet VM, by force and all at once, if the
// host is fenced.
func (f *Fence) Check(ctx context.Context) {
	f.mu.Lock()
	unheard := time.Duration(Boottime() - f.heard)
	due := f.fencedLocked()
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
	var wg sync.WaitGroup
	for _, vm := range vms {
		wg.Go(func() {
			sctx, cancel := context.WithTimeout(ctx, stopTimeout)
			defer cancel()
			if err := f.cfg.Stop(sctx, vm); err != nil {
				f.cfg.Log.Error("fence: VM not stopped; trying again", "vm", vm, "err", err)
			}
		})
	}
	wg.Wait()
}

// Boottime is CLOCK_BOOTTIME in nanoseconds: one clock for every process
// of the host, which goes on while it is suspended.
func Boottime() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts); err != nil {
		panic(err) // Linux has had it since 2.6.39
	}
	return ts.Nano()
}

func bootID() string {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// maxReport caps one report line.
const maxReport = 64

// Report formats a renewal report: it began at t (Boottime).
func Report(t int64) string { return "heard " + strconv.FormatInt(t, 10) + "\n" }

// ReadReports reads the helper's renewal reports from r until it ends.
// A report must be of the past minute by the host's clock.
func (f *Fence) ReadReports(r io.Reader) error {
	s := bufio.NewScanner(r)
	s.Buffer(make([]byte, maxReport), maxReport)
	for s.Scan() {
		t, err := parseReport(s.Text(), Boottime())
		if err != nil {
			return err
		}
		f.Heard(t)
	}
	return s.Err()
}

// parseReport checks a report against the clock's reading now.
func parseReport(line string, now int64) (int64, error) {
	v, ok := strings.CutPrefix(line, "heard ")
	if !ok {
		return 0, fmt.Errorf("fleet helper: bad report %.64q", line)
	}
	t, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("fleet helper: bad report %.64q", line)
	}
	if age := time.Duration(now - t); t < 0 || age < 0 || age > time.Minute {
		return 0, fmt.Errorf("fleet helper: report of %s ago is out of range", age)
	}
	return t, nil
}
