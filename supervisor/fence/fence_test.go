package fence

import (
	"bufio"
	"context"
	"errors"
	"io"
	"log/slog"
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
	f := New(Config{
		After: time.Minute,
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
	f.heard = time.Now().Add(-unheard)
	return f
}

func (h *host) stops() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	s := slices.Clone(h.stopped)
	slices.Sort(s)
	return s
}

func TestParseReport(t *testing.T) {
	const nowMono = int64(3600 * time.Second)
	now := time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)
	at := func(age time.Duration) string { return strings.TrimSuffix(Report(nowMono-int64(age)), "\n") }
	for _, age := range []time.Duration{0, time.Second, time.Minute} {
		got, err := parseReport(at(age), nowMono, now)
		if err != nil || !got.Equal(now.Add(-age)) {
			t.Errorf("report of %s ago: %v, %v; want %v", age, got, err, now.Add(-age))
		}
	}
	for _, line := range []string{
		at(-time.Nanosecond),              // the future
		at(-time.Hour),                    // far in the future
		at(time.Minute + time.Nanosecond), // over a minute old
		"heard 1",                         // an hour old
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
		if got, err := parseReport(line, nowMono, now); err == nil {
			t.Errorf("parseReport(%q) = %v, want an error", line, got)
		}
	}
}

// FuzzParseReport feeds parseReport arbitrary lines, as from a helper
// that cannot be trusted. Whatever the line, a time it accepts is of the
// past minute, and it is accepted only as a decimal monotonic time.
func FuzzParseReport(f *testing.F) {
	const nowMono = int64(3600 * time.Second)
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
	now := time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)
	f.Fuzz(func(t *testing.T, line string) {
		got, err := parseReport(line, nowMono, now)
		if err != nil {
			if len(err.Error()) > 1024 {
				t.Fatalf("error of %d bytes: the line is not capped in it", len(err.Error()))
			}
			return
		}
		if got.After(now) || now.Sub(got) > time.Minute {
			t.Fatalf("parseReport(%q) = %v: not of the past minute before %v", line, got, now)
		}
		v, ok := strings.CutPrefix(line, "heard ")
		mono, perr := strconv.ParseInt(v, 10, 64)
		if !ok || perr != nil || !got.Equal(now.Add(-time.Duration(nowMono-mono))) {
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
	if err := f.ReadReports(strings.NewReader(Report(Monotonic()) + Report(Monotonic()))); err != nil {
		t.Fatal(err)
	}
	if f.Fenced() {
		t.Error("fenced after a report of now")
	}
}

func TestReadReportsRefuses(t *testing.T) {
	for name, in := range map[string]string{
		"future":    Report(Monotonic() + int64(time.Hour)),
		"old":       Report(Monotonic() - int64(2*time.Minute)),
		"malformed": "heard now\n",
		"oversized": "heard " + strings.Repeat("1", maxReport) + "\n",
	} {
		t.Run(name, func(t *testing.T) {
			f := newHost().fence(time.Hour)
			// A good report after the bad one is never read.
			err := f.ReadReports(io.MultiReader(strings.NewReader(in), strings.NewReader(Report(Monotonic()))))
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
	f.check(context.Background())
	if s := h.stops(); len(s) != 0 {
		t.Fatalf("stopped %v while heard", s)
	}

	h.stopErr = map[string]error{"fleet-a": errors.New("boom")}
	f.heard = time.Now().Add(-f.cfg.After)
	f.check(context.Background())
	if s, want := h.stops(), []string{"fleet-a", "fleet-b"}; !slices.Equal(s, want) {
		t.Fatalf("stopped %v, want %v: every fleet VM, and no other", s, want)
	}

	// Heard of a renewal that began too long ago: still fenced.
	f.Heard(time.Now().Add(-time.Hour))
	if !f.Fenced() {
		t.Fatal("no longer fenced after an old renewal")
	}
	f.Heard(time.Now())
	if f.Fenced() {
		t.Fatal("still fenced after a renewal of now")
	}
	f.Heard(time.Now().Add(-time.Hour))
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
