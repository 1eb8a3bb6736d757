package main

// The soak (-soak): the load's clients at a lower rate for a long time,
// with carreld killed (SIGKILL) and started again every -soak-restart.
// Besides the load's own conditions (outside the restarts), it passes when
// after each restart every VM is re-adopted exactly once (carreld's log
// and the audit log's vm.lifecycle "adopted" records agree), and the
// clients' errors all fall within a restart, from the kill until every
// agent is ready again, and are clear ones.

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/supervisor/client"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
	"github.com/carrel-os/carrel/tests/harness"
)

// restartGrace is how long after every agent is ready again a client's
// call may still fail because of the restart.
const restartGrace = 5 * time.Second

type restartResult struct {
	killed, up, ready time.Time
	allReady          bool
	adopted           map[string]int // log lines this restart
	stats             procStats      // once every agent was ready
}

var adoptedLine = regexp.MustCompile(`msg="adopted running vm".* vm=(\S+)`)

// adoptions counts carreld's "adopted running vm" log lines per VM.
func adoptions(logs string) map[string]int {
	n := map[string]int{}
	for _, line := range strings.Split(logs, "\n") {
		if m := adoptedLine.FindStringSubmatch(line); m != nil {
			n[m[1]]++
		}
	}
	return n
}

// restart kills carreld, starts it again and waits until every VM's agent
// is ready.
func restart(t *tb, d *harness.Daemon, debugSock string, names []string) restartResult {
	prev := adoptions(d.Logs())
	rr := restartResult{killed: time.Now()}
	d.Kill()
	d.Start()
	rr.up = time.Now()
	c := client.New(d.Socket)
	defer c.CloseIdleConnections()
	for time.Since(rr.up) < 2*time.Minute && !rr.allReady {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		resp, err := c.VMs.ListVMs(ctx, connect.NewRequest(&apiv1.ListVMsRequest{}))
		cancel()
		if err == nil {
			ready := 0
			for _, v := range resp.Msg.Vms {
				if v.AgentState == apiv1.AgentState_AGENT_STATE_READY {
					ready++
				}
			}
			rr.allReady = ready == len(names)
		}
		if !rr.allReady {
			time.Sleep(100 * time.Millisecond)
		}
	}
	rr.ready = time.Now()
	now := adoptions(d.Logs())
	rr.adopted = map[string]int{}
	for _, n := range names {
		rr.adopted[n] = now[n] - prev[n]
	}
	rr.stats = mustStats(t, d, debugSock)
	return rr
}

func benchSoak(t *tb, d *harness.Daemon, debugSock string, cfg loadConfig, every time.Duration) bool {
	fmt.Printf("\nsoak: %d VMs (%s, 1 vCPU) x %d clients, %s between a client's rounds, for %s; carreld killed (SIGKILL) and restarted every %s\n",
		cfg.vms, cfg.memory, cfg.clients, cfg.pause, cfg.duration, every)
	names := bootLoadVMs(t, d, "soak", cfg)
	before := warmUp(t, d, debugSock, names, cfg)

	l := startLoad(d, names, cfg)
	from := time.Now()
	end := from.Add(cfg.duration)
	var windows []window
	var restarts []restartResult
	for next := from.Add(every); next.Before(end); next = next.Add(every) {
		time.Sleep(time.Until(next))
		rr := restart(t, d, debugSock, names)
		restarts = append(restarts, rr)
		windows = append(windows, window{vm: -1, from: rr.killed, to: rr.ready.Add(restartGrace), why: "restart"})
		fmt.Printf("  restart %d at %s: carreld up %s after the kill, every agent ready %s after (%v); adopted this time %v; %s\n",
			len(restarts), rr.killed.Sub(from).Round(time.Second), rr.up.Sub(rr.killed).Round(10*time.Millisecond),
			rr.ready.Sub(rr.killed).Round(10*time.Millisecond), rr.allReady, rr.adopted, rr.stats)
	}
	time.Sleep(time.Until(end))
	l.stopLoad()
	to := time.Now()
	samples := l.snapshot()
	after, settled := settleStats(t, d, debugSock, before, cfg.settle)

	fmt.Printf("\nsoak results over %s (%d clients, %d restarts):\n", to.Sub(from).Round(time.Second), cfg.vms*cfg.clients, len(restarts))
	opTable(samples, from, to)
	fmt.Printf("  carreld: %s\n", statsLine(before, after))
	ar := checkAudit(t, d, from, to)
	excused, bad := failures(samples, windows)
	for i, w := range windows {
		var in []sample
		for _, s := range excused {
			if w.covers(s) {
				in = append(in, s)
			}
		}
		printErrors(fmt.Sprintf("restart %d: clear errors within it", i+1), in, 4)
	}
	printErrors("errors outside a restart, or not clear", bad, 10)

	adoptOK, adoptHow := true, ""
	for i, rr := range restarts {
		for _, n := range names {
			if rr.adopted[n] != 1 || !rr.allReady {
				adoptOK = false
				adoptHow += fmt.Sprintf(" restart %d: %s adopted %d times (all ready: %v);", i+1, n, rr.adopted[n], rr.allReady)
			}
		}
	}
	auditAdoptOK, auditHow := true, ""
	for _, n := range names {
		if ar.adopted[n] != len(restarts) {
			auditAdoptOK = false
			auditHow += fmt.Sprintf(" %s %d;", n, ar.adopted[n])
		}
	}
	if adoptHow == "" {
		adoptHow = fmt.Sprintf("%d VMs x %d restarts", len(names), len(restarts))
	}
	if auditHow == "" {
		auditHow = fmt.Sprintf("%d per VM", len(restarts))
	}
	checks := []check{
		{"carreld restarted", len(restarts) > 0, fmt.Sprintf("%d times", len(restarts))},
		{"every VM re-adopted exactly once per restart (carreld's log)", adoptOK, adoptHow},
		{"and so says the audit log (vm.lifecycle adopted)", auditAdoptOK, auditHow},
		{"clients' errors only within restarts, and clear", len(bad) == 0, fmt.Sprintf("%d within restarts; %d outside or unclear", len(excused), len(bad))},
	}
	checks = append(checks, ar.checks()...)
	checks = append(checks, settleCheck(before, after, settled)...)
	removeVMs(d, names)
	return printChecks("soak", checks)
}

func removeVMs(d *harness.Daemon, names []string) {
	for _, n := range names {
		d.Must("vm", "rm", "--force", n)
	}
}
