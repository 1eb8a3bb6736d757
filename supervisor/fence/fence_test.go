package fence

import (
	"bufio"
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/carrel-os/carrel/supervisor/gen/apiv1/apiv1connect"
)

// host is a fake host's VMs, by name, and what the fence stopped.
type host struct {
	mu      sync.Mutex
	labels  map[string]map[string]string
	stopped []string
	stopErr map[string]error
}

func newHost() *host {
	return &host{labels: map[string]map[string]string{
		"fleet-a": {LabelRun: "uid-a"},
		"fleet-b": {LabelRun: "uid-b", "team": "x"},
		"mine":    {"team": "x"},
	}}
}

// fence returns a Fence over h, with an After of a minute, that has
// gone unheard for unheard.
func (h *host) fence(unheard time.Duration) *Fence {
	f := h.fenceWith(Config{})
	f.heard = Boottime() - int64(unheard)
	return f
}

func (h *host) fenceWith(cfg Config) *Fence {
	return New(Config{
		After: time.Minute,
		State: cfg.State,
		Labels: func(vm string) map[string]string {
			h.mu.Lock()
			defer h.mu.Unlock()
			return h.labels[vm]
		},
		Fleet: func() []string {
			h.mu.Lock()
			defer h.mu.Unlock()
			var out []string
			for vm, l := range h.labels {
				if l[LabelRun] != "" {
					out = append(out, vm)
				}
			}
			return out
		},
		Stop: func(_ context.Context, vm string) error {
			h.mu.Lock()
			defer h.mu.Unlock()
			h.stopped = append(h.stopped, vm)
			return h.stopErr[vm]
		},
		Log: slog.New(slog.DiscardHandler),
	})
}

func (h *host) stops() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	s := slices.Clone(h.stopped)
	slices.Sort(s)
	return s
}

func TestParseReport(t *testing.T) {
	const now = int64(3600 * time.Second)
	at := func(age time.Duration) string { return strings.TrimSuffix(Report(now-int64(age)), "\n") }
	for _, age := range []time.Duration{0, time.Second, time.Minute} {
		got, err := parseReport(at(age), now)
		if err != nil || got != now-int64(age) {
			t.Errorf("report of %s ago: %v, %v; want %v", age, got, err, now-int64(age))
		}
	}
	for _, line := range []string{
		at(-time.Nanosecond),              // the future
		at(-time.Hour),                    // far in the future
		at(time.Minute + time.Nanosecond), // over a minute old
		"heard 1",                         // an hour old
		"heard -1",
		"heard ",
		"heard",
		"heard x",
		"heard 1.5",
		"heard  3600000000000",
		"heard 3600000000000 ",
		"Heard 3600000000000",
		"heard 99999999999999999999",
		"",
	} {
		if got, err := parseReport(line, now); err == nil {
			t.Errorf("parseReport(%q) = %v, want an error", line, got)
		}
	}
}

// FuzzParseReport feeds parseReport arbitrary lines, as from a helper
// that cannot be trusted. Whatever the line, a time it accepts is of the
// past minute, and it is accepted only as a decimal time.
func FuzzParseReport(f *testing.F) {
	const now = int64(3600 * time.Second)
	f.Add("heard 3600000000000")
	f.Add("heard 3599000000000")
	f.Add("heard 3540000000000")
	f.Add("heard 3539999999999")
	f.Add("heard 3600000000001")
	f.Add("heard -9223372036854775808")
	f.Add("heard 9223372036854775807")
	f.Add("heard +3600000000000")
	f.Add("heard 0x10")
	f.Add("heard \xff\xfe" + strings.Repeat("é", 100))
	f.Add("")
	f.Fuzz(func(t *testing.T, line string) {
		got, err := parseReport(line, now)
		if err != nil {
			if len(err.Error()) > 1024 {
				t.Fatalf("error of %d bytes: the line is not capped in it", len(err.Error()))
			}
			return
		}
		if got > now || now-got > int64(time.Minute) {
			t.Fatalf("parseReport(%q) = %v: not of the past minute before %v", line, got, now)
		}
		v, ok := strings.CutPrefix(line, "heard ")
		n, perr := strconv.ParseInt(v, 10, 64)
		if !ok || perr != nil || got != n {
			t.Fatalf("parseReport(%q) = %v: accepted a line that is not a report", line, got)
		}
	})
}

func TestReadReports(t *testing.T) {
	h := newHost()
	f := h.fence(time.Hour)
	if !f.Fenced() {
		t.Fatal("unheard for an hour, and not fenced")
	}
	if err := f.ReadReports(strings.NewReader(Report(Boottime()) + Report(Boottime()))); err != nil {
		t.Fatal(err)
	}
	if f.Fenced() {
		t.Error("fenced after a report of now")
	}
}

func TestReadReportsRefuses(t *testing.T) {
	for name, in := range map[string]string{
		"future":    Report(Boottime() + int64(time.Hour)),
		"old":       Report(Boottime() - int64(2*time.Minute)),
		"malformed": "heard now\n",
		"oversized": "heard " + strings.Repeat("1", maxReport) + "\n",
	} {
		t.Run(name, func(t *testing.T) {
			f := newHost().fence(time.Hour)
			// A good report after the bad one is never read.
			err := f.ReadReports(io.MultiReader(strings.NewReader(in), strings.NewReader(Report(Boottime()))))
			if err == nil {
				t.Fatal("no error")
			}
			if name == "oversized" && !errors.Is(err, bufio.ErrTooLong) {
				t.Errorf("err = %v, want %v", err, bufio.ErrTooLong)
			}
			if !f.Fenced() {
				t.Error("heard after a bad report")
			}
		})
	}
}

func TestGuard(t *testing.T) {
	const exec = apiv1connect.VMServiceExecProcedure
	starts := []string{
		apiv1connect.VMServiceStartVMProcedure,
		apiv1connect.VMServiceResumeVMProcedure,
		apiv1connect.VMServiceResetVMProcedure,
		apiv1connect.VMServiceRestoreVMProcedure,
		apiv1connect.VMServiceForkVMProcedure,
	}
	for _, unheard := range []time.Duration{0, time.Hour} {
		f := newHost().fence(unheard)
		fenced := unheard > 0
		for _, p := range starts {
			if err := f.Guard(p, "fleet-a"); !errors.Is(err, ErrEngineOwned) {
				t.Errorf("fenced %v: Guard(%s, fleet VM) = %v, want %v", fenced, p, err, ErrEngineOwned)
			}
			if err := f.Guard(p, "mine"); err != nil {
				t.Errorf("fenced %v: Guard(%s, VM not of the fleet) = %v", fenced, p, err)
			}
		}
		var want error
		if fenced {
			want = ErrFenced
		}
		if err := f.Guard(exec, "fleet-b"); !errors.Is(err, want) {
			t.Errorf("fenced %v: Guard(Exec, fleet VM) = %v, want %v", fenced, err, want)
		}
		for _, vm := range []string{"mine", "no-such-vm"} {
			if err := f.Guard(exec, vm); err != nil {
				t.Errorf("fenced %v: Guard(Exec, %s) = %v", fenced, vm, err)
			}
		}
	}
}

func TestCheck(t *testing.T) {
	h := newHost()
	f := h.fence(0)
	f.Check(context.Background())
	if s := h.stops(); len(s) != 0 {
		t.Fatalf("stopped %v while heard", s)
	}

	h.stopErr = map[string]error{"fleet-a": errors.New("boom")}
	f.heard = Boottime() - int64(f.cfg.After)
	f.Check(context.Background())
	if s, want := h.stops(), []string{"fleet-a", "fleet-b"}; !slices.Equal(s, want) {
		t.Fatalf("stopped %v, want %v: every fleet VM, and no other", s, want)
	}

	// Heard of a renewal that began too long ago: still fenced.
	f.Heard(Boottime() - int64(time.Hour))
	if !f.Fenced() {
		t.Fatal("no longer fenced after an old renewal")
	}
	f.Heard(Boottime())
	if f.Fenced() {
		t.Fatal("still fenced after a renewal of now")
	}
	f.Heard(Boottime() - int64(time.Hour))
	if f.Fenced() {
		t.Fatal("an old renewal heard late took the place of a newer one")
	}
	if err := f.Guard(apiv1connect.VMServiceExecProcedure, "fleet-a"); err != nil {
		t.Errorf("Guard after the fence was heard again: %v", err)
	}
}

func TestWatch(t *testing.T) {
	h := newHost()
	f := h.fence(time.Hour)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		f.Watch(ctx, time.Millisecond)
	}()
	deadline := time.Now().Add(10 * time.Second)
	for len(h.stops()) < 2 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	cancel()
	<-done
	if s := h.stops(); !slices.Contains(s, "fleet-a") || !slices.Contains(s, "fleet-b") || slices.Contains(s, "mine") {
		t.Errorf("stopped %v, want the fleet VMs alone", s)
	}
}

// TestStateKept: the last renewal heard outlives carreld. A carreld that
// starts again after the time ran out starts fenced, and its first Check
// stops the fleet VMs that ran on meanwhile; one that starts in time
// does not.
func TestStateKept(t *testing.T) {
	state := filepath.Join(t.TempDir(), "fleet-heard")
	h := newHost()
	f := h.fenceWith(Config{State: state})
	f.heard = Boottime() - int64(40*time.Second)
	f.Heard(Boottime() - int64(30*time.Second))
	if again := h.fenceWith(Config{State: state}); again.Fenced() {
		t.Fatal("fenced at a restart within the time")
	}
	f.Heard(Boottime() - int64(59*time.Second)) // older: not kept
	b, err := os.ReadFile(state)
	if err != nil {
		t.Fatal(err)
	}
	boot, v, _ := strings.Cut(strings.TrimSpace(string(b)), " ")
	kept, _ := strconv.ParseInt(v, 10, 64)
	if boot != bootID() || Boottime()-kept < int64(30*time.Second) || Boottime()-kept > int64(time.Minute) {
		t.Fatalf("state %q: want this boot and the renewal of 30 s ago", b)
	}
	// As if carreld had been down for two minutes.
	if err := os.WriteFile(state, []byte(boot+" "+strconv.FormatInt(Boottime()-int64(2*time.Minute), 10)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	again := h.fenceWith(Config{State: state})
	if !again.Fenced() {
		t.Fatal("not fenced at a restart after the time ran out")
	}
	again.Check(context.Background())
	if s := h.stops(); !slices.Equal(s, []string{"fleet-a", "fleet-b"}) {
		t.Errorf("stopped %v at the restart, want the fleet VMs", s)
	}
	// Another boot's state says nothing of this one.
	if err := os.WriteFile(state, []byte("another-boot 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if h.fenceWith(Config{State: state}).Fenced() {
		t.Error("fenced by the state of another boot")
	}
}
