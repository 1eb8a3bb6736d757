package main

// Load (-load) and fault injection under load (-fault): N VMs booted by one
// carreld, C clients per VM, each its own connection to carreld through the
// Go SDK, looping over an exec of a short command, a 1 MiB copy into the
// guest and back out, a stat and a listing, for a set time.
//
// Reported: throughput and p50/p99 per operation; carreld's RSS, goroutines
// (its --debug-socket) and open fds before the load and once it has
// stopped; each QEMU's PSS; audit records per second.
//
// Passes when no operation failed; every intent in the audit log has its
// outcome; `carrel audit verify` is clean; and carreld's RSS, goroutines
// and fds come back to within 10% of where they started once the clients
// are gone.
//
// With -fault, midway through, one VM's QEMU gets SIGSTOP for -fault-stop
// and then SIGCONT. It passes when the other VMs' p99 while it is stopped
// is at most 20% above their p99 in the same length of time just before,
// operation by operation; the stopped VM is marked unhealthy and then
// healthy again; and its own clients' errors are clear ones and fall
// between the SIGSTOP and its agent's return to ready.

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/client"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
	"github.com/carrel-os/carrel/tests/harness"
)

// The operations of one client round, in order.
var loadOps = []string{"exec", "cp-in", "cp-out", "stat", "list"}

const (
	copyBytes = 1 << 20
	// settleTolerance is how far above its start carreld may stay once
	// the load has stopped.
	settleTolerance = 0.10
	// faultP99Rise is how much the other VMs' p99 may rise while one VM
	// is stopped.
	faultP99Rise = 0.20
)

type loadConfig struct {
	vms, clients int
	duration     time.Duration
	memory       string        // each VM's, as `carrel vm create --memory` takes it
	pause        time.Duration // between a client's rounds: the soak's lower rate
	opTimeout    time.Duration // each operation's deadline
	settle       time.Duration // longest wait for carreld to come back to its start
	warmup       time.Duration // the same load, before the baseline
	fault        bool
	faultStop    time.Duration
}

// sample is one operation.
type sample struct {
	at  time.Time // when it started
	vm  int
	op  string
	lat time.Duration
	err error
}

// window is a span in which a VM (all VMs when vm < 0) may fail clearly:
// a restart of carreld, or its QEMU stopped.
type window struct {
	vm       int
	from, to time.Time
	why      string
}

func (w window) covers(s sample) bool {
	end := s.at.Add(s.lat)
	return (w.vm < 0 || w.vm == s.vm) && !end.Before(w.from) && !s.at.After(w.to)
}

// load is a running workload.
type load struct {
	cfg     loadConfig
	d       *harness.Daemon
	names   []string
	payload []byte

	mu      sync.Mutex
	samples []sample
	clients []*client.Client
	wg      sync.WaitGroup
	stop    chan struct{}
}

func (l *load) vmName(i int) string { return l.names[i] }

// bootLoadVMs creates the VMs one after another and waits for each to
// answer an exec.
func bootLoadVMs(t *tb, d *harness.Daemon, prefix string, cfg loadConfig) []string {
	c := client.New(d.Socket)
	defer c.CloseIdleConnections()
	var names []string
	for i := 0; i < cfg.vms; i++ {
		name := fmt.Sprintf("%s%d", prefix, i)
		start := time.Now()
		d.Must("vm", "create", name, "--memory", cfg.memory, "--cpus", "1")
		ctx, cancel := context.WithTimeout(context.Background(), cfg.opTimeout)
		err := execEcho(ctx, c, name)
		cancel()
		if err != nil {
			t.Fatalf("first exec in %s: %v", name, err)
		}
		fmt.Printf("  %s up in %s\n", name, time.Since(start).Round(100*time.Millisecond))
		names = append(names, name)
	}
	return names
}

// warmUp runs the load for cfg.warmup and returns carreld's stats once it
// has stopped: the baseline. Memory that carreld keeps because it has
// served this load once (code paths first run, buffer pools grown to the
// load's concurrency, heap the runtime has not yet returned) is then in
// the baseline; what grows with the amount of work, as a leak does, is
// not.
func warmUp(t *tb, d *harness.Daemon, debugSock string, names []string, cfg loadConfig) procStats {
	time.Sleep(5 * time.Second) // let boots' leftovers settle
	cold := mustStats(t, d, debugSock)
	fmt.Printf("  carreld with the VMs booted, before any load: %s\n", cold)
	if cfg.warmup <= 0 {
		return cold
	}
	l := startLoad(d, names, cfg)
	time.Sleep(cfg.warmup)
	l.stopLoad()
	if _, bad := failures(l.snapshot(), nil); len(bad) > 0 {
		printErrors("errors while warming up", bad, 10)
		t.Fatalf("the warm-up (%s of the same load) failed", cfg.warmup)
	}
	time.Sleep(5 * time.Second)
	before := mustStats(t, d, debugSock)
	fmt.Printf("  after %s of the same load as a warm-up (the baseline): %s\n", cfg.warmup, before)
	return before
}

// startLoad starts cfg.clients clients per VM; they run until stopLoad.
func startLoad(d *harness.Daemon, names []string, cfg loadConfig) *load {
	l := &load{cfg: cfg, d: d, names: names, payload: make([]byte, copyBytes), stop: make(chan struct{})}
	rand.Read(l.payload)
	for i := range names {
		for j := 0; j < cfg.clients; j++ {
			c := client.New(d.Socket)
			l.clients = append(l.clients, c)
			l.wg.Add(1)
			go l.run(c, i, j)
		}
	}
	return l
}

// stopLoad lets every client finish its current operation, then closes
// their connections, as clients that exit would.
func (l *load) stopLoad() {
	close(l.stop)
	l.wg.Wait()
	for _, c := range l.clients {
		c.CloseIdleConnections()
	}
}

func (l *load) stopped() bool {
	select {
	case <-l.stop:
		return true
	default:
		return false
	}
}

func (l *load) run(c *client.Client, vm, id int) {
	defer l.wg.Done()
	name := l.names[vm]
	path := fmt.Sprintf("/workspace/load-%d.bin", id)
	var got bytes.Buffer
	for !l.stopped() {
		ops := []func(context.Context) error{
			func(ctx context.Context) error { return execEcho(ctx, c, name) },
			func(ctx context.Context) error {
				_, err := c.Upload(ctx, name, path, bytes.NewReader(l.payload), 0o644)
				return err
			},
			func(ctx context.Context) error {
				got.Reset()
				n, err := c.Download(ctx, name, path, &got)
				if err == nil && (n != copyBytes || !bytes.Equal(got.Bytes(), l.payload)) {
					err = fmt.Errorf("downloaded %d bytes that differ from the %d uploaded", n, copyBytes)
				}
				return err
			},
			func(ctx context.Context) error {
				fi, err := c.Stat(ctx, name, path)
				if err == nil && fi.GetSize() != copyBytes {
					err = fmt.Errorf("stat: size %d, want %d", fi.GetSize(), copyBytes)
				}
				return err
			},
			func(ctx context.Context) error { return list(ctx, c, name, "/workspace") },
		}
		for i, op := range ops {
			if l.stopped() {
				return
			}
			if err := l.do(vm, loadOps[i], op); err != nil {
				time.Sleep(100 * time.Millisecond) // no spinning while carreld is down
			}
		}
		if l.cfg.pause > 0 {
			select {
			case <-l.stop:
			case <-time.After(l.cfg.pause):
			}
		}
	}
}

func (l *load) do(vm int, op string, f func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.opTimeout)
	defer cancel()
	start := time.Now()
	err := f(ctx)
	s := sample{at: start, vm: vm, op: op, lat: time.Since(start), err: err}
	l.mu.Lock()
	l.samples = append(l.samples, s)
	l.mu.Unlock()
	return err
}

func (l *load) snapshot() []sample {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]sample(nil), l.samples...)
}

func execEcho(ctx context.Context, c *client.Client, vm string) error {
	var out bytes.Buffer
	st, err := c.Run(ctx, client.Session{VM: vm, Stdout: &out, Start: &agentv1.ExecRequest{Argv: []string{"echo", "ok"}}})
	switch {
	case err != nil:
		return err
	case st.Code != 0 || st.Signal != "":
		return fmt.Errorf("echo ok: exit %d signal %q", st.Code, st.Signal)
	case out.String() != "ok\n":
		return fmt.Errorf("echo ok printed %q", out.String())
	}
	return nil
}

func list(ctx context.Context, c *client.Client, vm, path string) error {
	req := connect.NewRequest(&agentv1.ListRequest{Path: path})
	req.Header().Set(protocol.VMHeader, vm)
	s, err := c.Files.List(ctx, req)
	if err != nil {
		return err
	}
	defer s.Close()
	n := 0
	for s.Receive() {
		n += len(s.Msg().Entries)
	}
	if err := s.Err(); err != nil {
		return err
	}
	if n == 0 {
		return errors.New("list: no entries")
	}
	return nil
}

// clearError says whether err tells a client what happened: a connect
// code other than unknown, and a message.
func clearError(err error) bool {
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return false
	}
	return ce.Code() != connect.CodeUnknown && strings.TrimSpace(ce.Message()) != ""
}

func errorCode(err error) string {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Code().String()
	}
	return "not a connect error"
}

// opTable prints throughput and latency per operation over samples
// between from and to, and returns the failures among them.
func opTable(samples []sample, from, to time.Time) {
	secs := to.Sub(from).Seconds()
	fmt.Printf("  %-7s %8s %7s %9s %10s %10s %10s\n", "op", "count", "errors", "ops/s", "p50", "p99", "max")
	var total, errs int
	for _, op := range loadOps {
		var lat []time.Duration
		n, e := 0, 0
		for _, s := range samples {
			if s.op != op || s.at.Before(from) || s.at.After(to) {
				continue
			}
			n++
			if s.err != nil {
				e++
				continue
			}
			lat = append(lat, s.lat)
		}
		total, errs = total+n, errs+e
		fmt.Printf("  %-7s %8d %7d %9.2f %10s %10s %10s\n", op, n, e, float64(n)/secs, fmtDur(percentile(lat, 50)), fmtDur(percentile(lat, 99)), fmtDur(percentile(lat, 100)))
	}
	fmt.Printf("  %-7s %8d %7d %9.2f   (client rounds/s %.2f; MiB/s copied both ways %.1f)\n", "all", total, errs, float64(total)/secs,
		float64(total)/float64(len(loadOps))/secs, 2*float64(total)/float64(len(loadOps))/secs)
}

// failures splits the failed samples into those a window excuses (and
// that were clear) and the rest.
func failures(samples []sample, windows []window) (excused, bad []sample) {
	for _, s := range samples {
		if s.err == nil {
			continue
		}
		ok := false
		for _, w := range windows {
			if w.covers(s) && clearError(s.err) {
				ok = true
				break
			}
		}
		if ok {
			excused = append(excused, s)
		} else {
			bad = append(bad, s)
		}
	}
	return excused, bad
}

// printErrors prints how many errors of each code and message there were,
// most frequent first, at most max kinds.
func printErrors(label string, samples []sample, max int) {
	if len(samples) == 0 {
		return
	}
	count := map[string]int{}
	for _, s := range samples {
		msg := s.err.Error()
		if len(msg) > 160 {
			msg = msg[:160] + "..."
		}
		count[fmt.Sprintf("%s %s [%s]: %s", s.op, strings.ToLower(errorCode(s.err)), s.vmLabel(), msg)]++
	}
	keys := make([]string, 0, len(count))
	for k := range count {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return count[keys[i]] > count[keys[j]] })
	fmt.Printf("  %s: %d\n", label, len(samples))
	for i, k := range keys {
		if i == max {
			fmt.Printf("    ... and %d more kinds\n", len(keys)-max)
			break
		}
		fmt.Printf("    %5d x %s\n", count[k], k)
	}
}

func (s sample) vmLabel() string { return "vm " + strconv.Itoa(s.vm) }

// benchLoad runs the load (and, with cfg.fault, the fault injection) on d,
// which must have been started with --debug-socket debugSock. It returns
// whether every check passed.
func benchLoad(t *tb, d *harness.Daemon, debugSock string, cfg loadConfig) bool {
	fmt.Printf("\nload: %d VMs (%s, 1 vCPU) x %d clients for %s, each round: exec `echo ok`, 1 MiB cp in, 1 MiB cp out, stat, list; %s per operation\n",
		cfg.vms, cfg.memory, cfg.clients, cfg.duration, cfg.opTimeout)
	names := bootLoadVMs(t, d, "load", cfg)
	before := warmUp(t, d, debugSock, names, cfg)
	pssBefore := qemuPSSAll(t, d, names)

	l := startLoad(d, names, cfg)
	from := time.Now()
	var windows []window
	var fr *faultResult
	if cfg.fault {
		at := cfg.duration/2 - cfg.faultStop/2
		if at < cfg.faultStop {
			t.Fatalf("-load-duration %s is too short for a %s fault with as long a measurement before it", cfg.duration, cfg.faultStop)
		}
		time.Sleep(at)
		fr = injectFault(t, d, names, len(names)-1, cfg.faultStop)
		windows = append(windows, window{vm: fr.vm, from: fr.stopped, to: fr.ready.Add(5 * time.Second), why: "QEMU stopped"})
	}
	time.Sleep(time.Until(from.Add(cfg.duration)))
	l.stopLoad()
	to := time.Now()
	samples := l.snapshot()
	pssAfter := qemuPSSAll(t, d, names)
	after, settled := settleStats(t, d, debugSock, before, cfg.settle)

	fmt.Printf("\nload results over %s (%d clients):\n", to.Sub(from).Round(time.Second), cfg.vms*cfg.clients)
	opTable(samples, from, to)
	fmt.Printf("  carreld: %s\n", statsLine(before, after))
	fmt.Printf("  QEMU PSS per VM, median (total): before the load %.1f MiB (%.0f), after %.1f MiB (%.0f)\n",
		medianFloat(pssBefore), sum(pssBefore), medianFloat(pssAfter), sum(pssAfter))
	ar := checkAudit(t, d, from, to)
	excused, bad := failures(samples, windows)
	printErrors("errors the fault's window excuses (clear, on the stopped VM)", excused, 6)
	printErrors("errors", bad, 10)

	checks := []check{
		{"no operation failed" + map[bool]string{true: " (outside the stopped VM's window)"}[cfg.fault], len(bad) == 0, fmt.Sprintf("%d errors", len(bad))},
	}
	checks = append(checks, ar.checks()...)
	checks = append(checks, settleCheck(before, after, settled)...)
	if fr != nil {
		checks = append(checks, fr.report(samples, names)...)
		// What carreld said about the stopped VM's agent, to explain
		// the timings.
		for _, line := range strings.Split(d.Logs(), "\n") {
			if strings.Contains(line, "vm="+names[fr.vm]+" ") && strings.Contains(line, "guest agent") {
				fmt.Printf("  carreld: %s\n", line)
			}
		}
	}
	removeVMs(d, names)
	return printChecks("load", checks)
}

// faultResult is what injectFault saw.
type faultResult struct {
	vm                              int
	stop                            time.Duration
	stopped, unhealthy, cont, ready time.Time
	sawUnhealthy, sawReady          bool
}

// injectFault stops VM vm's QEMU for stop, and watches its agent's state
// through the API until it is ready again (at most two minutes after
// SIGCONT).
func injectFault(t *tb, d *harness.Daemon, names []string, vm int, stop time.Duration) *faultResult {
	pid := qemuPid(t, d, names[vm])
	c := client.New(d.Socket)
	defer c.CloseIdleConnections()
	fr := &faultResult{vm: vm, stop: stop}
	fmt.Printf("  fault: SIGSTOP to %s's QEMU (pid %d) for %s\n", names[vm], pid, stop)
	fr.stopped = time.Now()
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	state := func() apiv1.AgentState {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		resp, err := c.VMs.GetVM(ctx, connect.NewRequest(&apiv1.GetVMRequest{Name: names[vm]}))
		if err != nil {
			return apiv1.AgentState_AGENT_STATE_UNSPECIFIED
		}
		return resp.Msg.GetVm().GetAgentState()
	}
	for time.Since(fr.stopped) < stop {
		if !fr.sawUnhealthy && state() == apiv1.AgentState_AGENT_STATE_UNHEALTHY {
			fr.sawUnhealthy, fr.unhealthy = true, time.Now()
		}
		time.Sleep(250 * time.Millisecond)
	}
	syscall.Kill(pid, syscall.SIGCONT)
	fr.cont = time.Now()
	for time.Since(fr.cont) < 2*time.Minute {
		if state() == apiv1.AgentState_AGENT_STATE_READY {
			fr.sawReady, fr.ready = true, time.Now()
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	if !fr.sawReady {
		fr.ready = time.Now()
	}
	return fr
}

// report compares the other VMs' p99 while the VM was stopped with the
// same length of time just before, operation by operation.
func (fr *faultResult) report(samples []sample, names []string) []check {
	fmt.Printf("\nfault injection: %s's QEMU stopped for %s\n", names[fr.vm], fr.stop)
	if fr.sawUnhealthy {
		fmt.Printf("  marked unhealthy %s after SIGSTOP\n", fr.unhealthy.Sub(fr.stopped).Round(100*time.Millisecond))
	}
	if fr.sawReady {
		fmt.Printf("  ready again %s after SIGCONT\n", fr.ready.Sub(fr.cont).Round(100*time.Millisecond))
	}
	beforeFrom := fr.stopped.Add(-fr.stop)
	fmt.Printf("  the other VMs' latency, %s before the SIGSTOP against the %s it lasted:\n", fr.stop, fr.stop)
	fmt.Printf("  %-7s %7s %10s %7s %10s %8s\n", "op", "n before", "p99", "n during", "p99", "change")
	ok := true
	worst := ""
	for _, op := range loadOps {
		var b, du []time.Duration
		for _, s := range samples {
			if s.vm == fr.vm || s.op != op || s.err != nil {
				continue
			}
			switch {
			case !s.at.Before(beforeFrom) && s.at.Before(fr.stopped):
				b = append(b, s.lat)
			case !s.at.Before(fr.stopped) && s.at.Before(fr.cont):
				du = append(du, s.lat)
			}
		}
		pb, pd := percentile(b, 99), percentile(du, 99)
		change := 0.0
		if pb > 0 {
			change = float64(pd)/float64(pb) - 1
		}
		if len(b) == 0 || len(du) == 0 || change > faultP99Rise {
			ok = false
			worst += fmt.Sprintf(" %s %+.0f%%", op, 100*change)
		}
		fmt.Printf("  %-7s %7d %10s %7d %10s %+7.0f%%\n", op, len(b), fmtDur(pb), len(du), fmtDur(pd), 100*change)
	}
	if worst == "" {
		worst = " none above"
	}
	return []check{
		{fmt.Sprintf("the other VMs' p99 rose by at most %.0f%% while one was stopped", 100*faultP99Rise), ok, "over:" + worst},
		{"the stopped VM was marked unhealthy", fr.sawUnhealthy, fmtSince(fr.sawUnhealthy, fr.unhealthy, fr.stopped, "after SIGSTOP")},
		{"then healthy again", fr.sawReady, fmtSince(fr.sawReady, fr.ready, fr.cont, "after SIGCONT")},
	}
}

func fmtSince(ok bool, at, from time.Time, what string) string {
	if !ok {
		return "never"
	}
	return at.Sub(from).Round(100*time.Millisecond).String() + " " + what
}

// qemuPid is the pid of VM name's QEMU, as carreld reports it (either
// driver).
func qemuPid(t *tb, d *harness.Daemon, name string) int {
	var v struct {
		Pid int `json:"pid"`
	}
	if err := json.Unmarshal([]byte(d.Must("vm", "inspect", name)), &v); err != nil || v.Pid == 0 {
		t.Fatalf("pid of %s: %+v, %v", name, v, err)
	}
	return v.Pid
}

// qemuPSSAll is each VM's QEMU PSS in MiB.
func qemuPSSAll(t *tb, d *harness.Daemon, names []string) []float64 {
	var v []float64
	for _, name := range names {
		total, _, err := qemuPSS(qemuPid(t, d, name), 0)
		if err != nil {
			t.Fatal(err)
		}
		v = append(v, float64(total)/(1<<20))
	}
	return v
}

func sum(v []float64) float64 {
	s := 0.0
	for _, x := range v {
		s += x
	}
	return s
}
