package main

// What the load and the soak measure of carreld from outside (its RSS,
// threads and open fds from /proc; its goroutines from --debug-socket),
// and their check of the audit log: every intent has its outcome, carrel
// audit verify is clean, and VMs re-adopted as often as carreld restarted.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/tests/harness"
)

// procStats is one look at carreld.
type procStats struct {
	rss, rssAnon, rssFile uint64
	threads, fds, gorts   int
	heap                  heapStats
}

// heapStats are Go's own memory statistics (runtime.MemStats), which tell
// a leak (HeapAlloc keeps growing) from memory the runtime holds on to
// (idle, not yet released to the kernel).
type heapStats struct{ alloc, inuse, idle, released, sys uint64 }

func mib(b uint64) float64 { return float64(b) / (1 << 20) }

func (s procStats) String() string {
	return fmt.Sprintf("RSS %.1f MiB (anon %.1f, file %.1f; Go live heap %.1f, idle not released %.1f), %d goroutines, %d fds, %d threads",
		mib(s.rss), mib(s.rssAnon), mib(s.rssFile), mib(s.heap.alloc), mib(s.heap.idle-s.heap.released), s.gorts, s.fds, s.threads)
}

func carreldStats(pid int, debugSock string) (procStats, error) {
	var s procStats
	var err error
	if s.rss, err = rss(pid); err != nil {
		return s, err
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return s, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		k, v, _ := strings.Cut(line, ":")
		var kb uint64
		switch k {
		case "Threads":
			fmt.Sscan(v, &s.threads)
		case "RssAnon":
			fmt.Sscan(v, &kb)
			s.rssAnon = kb << 10
		case "RssFile":
			fmt.Sscan(v, &kb)
			s.rssFile = kb << 10
		}
	}
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return s, err
	}
	s.fds = len(fds)
	if s.gorts, err = goroutines(debugSock); err != nil {
		return s, err
	}
	s.heap, err = goHeap(debugSock)
	return s, err
}

// debugGet fetches a profile from carreld's --debug-socket.
func debugGet(sock, path string) (string, error) {
	hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}}
	defer hc.CloseIdleConnections()
	resp, err := hc.Get("http://carreld" + path)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	return string(b), err
}

// goroutines reads carreld's goroutine count.
func goroutines(sock string) (int, error) {
	prof, err := debugGet(sock, "/debug/pprof/goroutine?debug=1")
	if err != nil {
		return 0, err
	}
	var n int
	if _, err := fmt.Sscanf(prof, "goroutine profile: total %d", &n); err != nil {
		return 0, fmt.Errorf("goroutine profile: %.80q: %w", prof, err)
	}
	return n, nil
}

// goHeap reads carreld's runtime.MemStats from the end of its heap
// profile ("# HeapAlloc = N" lines), after garbage collections (gc=1), so
// that HeapAlloc is the live heap. It asks twice: what sync.Pools held
// survives the first collection (in their victim caches) and goes with
// the second.
func goHeap(sock string) (heapStats, error) {
	var h heapStats
	if _, err := debugGet(sock, "/debug/pprof/heap?gc=1"); err != nil {
		return h, err
	}
	prof, err := debugGet(sock, "/debug/pprof/heap?gc=1&debug=1")
	if err != nil {
		return h, err
	}
	fields := map[string]*uint64{"HeapAlloc": &h.alloc, "HeapInuse": &h.inuse, "HeapIdle": &h.idle, "HeapReleased": &h.released, "Sys": &h.sys}
	for _, line := range strings.Split(prof, "\n") {
		var k string
		var v uint64
		if n, _ := fmt.Sscanf(line, "# %s = %d", &k, &v); n == 2 {
			if p, ok := fields[k]; ok {
				*p = v
			}
		}
	}
	if h.sys == 0 {
		return h, fmt.Errorf("no runtime.MemStats in the heap profile")
	}
	return h, nil
}

func mustStats(t *tb, d *harness.Daemon, debugSock string) procStats {
	s, err := carreldStats(d.Pid(), debugSock)
	if err != nil {
		t.Fatalf("carreld's stats: %v", err)
	}
	return s
}

// within says whether after is at most settleTolerance above before.
func within(before, after float64) bool { return after <= before*(1+settleTolerance) }

func settledFrom(before, after procStats) bool {
	return within(float64(before.rss), float64(after.rss)) && within(float64(before.gorts), float64(after.gorts)) &&
		within(float64(before.fds), float64(after.fds)) && within(float64(before.heap.alloc), float64(after.heap.alloc))
}

// settleStats looks at carreld every few seconds after the load until it
// is back within settleTolerance of before, or limit has passed; it
// returns the last look and how long it took (negative if it never came
// back).
func settleStats(t *tb, d *harness.Daemon, debugSock string, before procStats, limit time.Duration) (procStats, time.Duration) {
	start := time.Now()
	shown := start
	for {
		s := mustStats(t, d, debugSock)
		if settledFrom(before, s) {
			return s, time.Since(start)
		}
		if time.Since(start) > limit {
			return s, -1
		}
		if time.Since(shown) >= 30*time.Second {
			fmt.Printf("  %s after the load: %s\n", time.Since(start).Round(time.Second), s)
			shown = time.Now()
		}
		time.Sleep(5 * time.Second)
	}
}

func statsLine(before, after procStats) string {
	return fmt.Sprintf("before the load %s; after %s", before, after)
}

func settleCheck(before, after procStats, took time.Duration) []check {
	how := "back within " + took.Round(time.Second).String() + " of the load's end"
	if took < 0 {
		how = "not back in time"
	}
	pct := func(b, a float64) string { return fmt.Sprintf("%+.0f%%", 100*(a/b-1)) }
	return []check{
		{"carreld's RSS back within 10% of its start", within(float64(before.rss), float64(after.rss)),
			fmt.Sprintf("%.1f -> %.1f MiB (%s), %s", float64(before.rss)/(1<<20), float64(after.rss)/(1<<20), pct(float64(before.rss), float64(after.rss)), how)},
		{"its goroutines back within 10%", within(float64(before.gorts), float64(after.gorts)),
			fmt.Sprintf("%d -> %d (%s)", before.gorts, after.gorts, pct(float64(before.gorts), float64(after.gorts)))},
		{"its open fds back within 10%", within(float64(before.fds), float64(after.fds)),
			fmt.Sprintf("%d -> %d (%s)", before.fds, after.fds, pct(float64(before.fds), float64(after.fds)))},
		// RSS can hide a leak behind heap the runtime kept from the
		// warm-up; the live heap cannot.
		{"its Go live heap back within 10% (a leak shows here first)", within(float64(before.heap.alloc), float64(after.heap.alloc)),
			fmt.Sprintf("%.1f -> %.1f MiB (%s)", mib(before.heap.alloc), mib(after.heap.alloc), pct(float64(before.heap.alloc), float64(after.heap.alloc)))},
	}
}

// check is one pass condition.
type check struct {
	what string
	ok   bool
	how  string
}

// printChecks prints the checks as a table and says whether all passed.
func printChecks(what string, checks []check) bool {
	fmt.Printf("\n%s pass conditions:\n", what)
	all := true
	for _, c := range checks {
		v := "PASS"
		if !c.ok {
			v, all = "FAIL", false
		}
		fmt.Printf("  %-4s  %-66s %s\n", v, c.what, c.how)
	}
	if all {
		fmt.Printf("%s: PASS\n", what)
	} else {
		fmt.Printf("%s: FAIL\n", what)
	}
	return all
}

// auditResult is what the audit log held.
type auditResult struct {
	records, inWindow int
	window            time.Duration
	intents           int
	open              []uint64 // intents without an outcome
	twice             []uint64 // intents with more than one
	unknown           int      // outcomes a restart's recovery wrote
	adopted           map[string]int
	kinds             map[string]int
	verifyOK          bool
	verifyOut         string
}

// checkAudit reads the log through the audit package (every record, once),
// and verifies it through `carrel audit verify`, as a reviewer would.
func checkAudit(t *tb, d *harness.Daemon, from, to time.Time) *auditResult {
	dir := filepath.Join(d.State, "audit")
	ar := &auditResult{window: to.Sub(from), adopted: map[string]int{}, kinds: map[string]int{}}
	outcomes := map[uint64]int{}
	intents := map[uint64]bool{}
	err := audit.Scan(dir, func(seq uint64, _ int64, payload []byte) error {
		r, err := audit.Decode(payload)
		if err != nil {
			return fmt.Errorf("record %d: %w", seq, err)
		}
		ar.records++
		ar.kinds[r.Kind]++
		if !r.Time.Before(from) && !r.Time.After(to) {
			ar.inWindow++
		}
		if r.Kind == audit.KindIntent {
			intents[seq] = true
		}
		if r.Intent != nil {
			outcomes[*r.Intent]++
		}
		switch r.Kind {
		case audit.KindOutcome:
			var o audit.OutcomeData
			if json.Unmarshal(r.Data, &o) == nil && o.Outcome == audit.OutcomeUnknown {
				ar.unknown++
			}
		case audit.KindVMLifecycle:
			var l audit.Lifecycle
			if json.Unmarshal(r.Data, &l) == nil && l.Event == "adopted" {
				ar.adopted[r.VM]++
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("read the audit log: %v", err)
	}
	ar.intents = len(intents)
	for seq := range intents {
		switch outcomes[seq] {
		case 0:
			ar.open = append(ar.open, seq)
		case 1:
		default:
			ar.twice = append(ar.twice, seq)
		}
	}
	sort.Slice(ar.open, func(i, j int) bool { return ar.open[i] < ar.open[j] })
	r := d.CarrelTimeout(10*time.Minute, "audit", "verify", "--dir", dir)
	ar.verifyOK = r.Code == 0
	ar.verifyOut = strings.TrimSpace(r.Stdout + r.Stderr)

	kinds := make([]string, 0, len(ar.kinds))
	for k := range ar.kinds {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	var kl []string
	for _, k := range kinds {
		kl = append(kl, fmt.Sprintf("%s %d", k, ar.kinds[k]))
	}
	fmt.Printf("  audit: %d records in all (%s); %d written during the load, %.1f records/s\n",
		ar.records, strings.Join(kl, ", "), ar.inWindow, float64(ar.inWindow)/ar.window.Seconds())
	fmt.Printf("  audit: %d intents, %d without an outcome, %d with more than one, %d outcomes \"unknown\" (written by recovery after a crash)\n",
		ar.intents, len(ar.open), len(ar.twice), ar.unknown)
	fmt.Printf("  carrel audit verify: %s\n", strings.ReplaceAll(ar.verifyOut, "\n", "; "))
	return ar
}

func (ar *auditResult) checks() []check {
	first := func(v []uint64) string {
		if len(v) == 0 {
			return "none"
		}
		if len(v) > 5 {
			return fmt.Sprintf("%d, first seqs %v", len(v), v[:5])
		}
		return fmt.Sprintf("%d: seqs %v", len(v), v)
	}
	return []check{
		{"every intent in the audit log has its outcome", len(ar.open) == 0, fmt.Sprintf("%d intents; open: %s", ar.intents, first(ar.open))},
		{"and no intent has two", len(ar.twice) == 0, first(ar.twice)},
		{"carrel audit verify is clean", ar.verifyOK, firstLine(ar.verifyOut)},
	}
}

func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	return s
}
