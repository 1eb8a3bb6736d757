package main

// Snapshots, restore and fork (issue 17's targets): restore to agent-ready
// against a cold boot of the same VM, alternating; a fork of a warm VM to
// agent-ready; a snapshot's time and size against the guest's RAM; and the
// host memory of forks of one VM against as many cold boots.

import (
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/carrel-os/carrel/tests/harness"
)

func timed(d *harness.Daemon, args ...string) time.Duration {
	start := time.Now()
	d.Must(args...)
	return time.Since(start)
}

type benchSnapshot struct {
	Name       string `json:"name"`
	StateBytes string `json:"stateBytes"`
	Bytes      string `json:"bytes"`
}

func snapshotsOf(t *tb, d *harness.Daemon, vm string) map[string]benchSnapshot {
	var ls struct {
		Snapshots []benchSnapshot `json:"snapshots"`
	}
	if err := json.Unmarshal([]byte(d.Must("vm", "snapshot", "ls", vm, "--output", "json")), &ls); err != nil {
		t.Fatal(err)
	}
	out := map[string]benchSnapshot{}
	for _, s := range ls.Snapshots {
		out[s.Name] = s
	}
	return out
}

func mibOf(s string) float64 {
	n, _ := strconv.ParseUint(s, 10, 64)
	return float64(n) / (1 << 20)
}

func benchSnapshots(t *tb, d *harness.Daemon, driverName string, rounds, forks int) {
	const memory = 256 << 20
	fmt.Printf("\nsnapshots (%s driver, %d MiB, 1 vCPU; times to agent-ready, through the CLI):\n", driverName, memory>>20)
	d.Must("vm", "create", "snapbench", "--memory", "256M", "--cpus", "1")
	defer d.Must("vm", "rm", "--force", "snapbench")
	d.Must("exec", "snapbench", "--", "true")
	_, touched, err := qemuPSS(qemuPid(t, d, "snapbench"), memory)
	if err != nil {
		t.Fatal(err)
	}
	took := timed(d, "vm", "snapshot", "snapbench", "--name", "base")
	s := snapshotsOf(t, d, "snapbench")["base"]
	fmt.Printf("  snapshot of a booted VM: %s; state %.1f MiB, with its disk layers %.1f MiB; guest RAM %d MiB, of which the guest had touched %.1f MiB (zero pages cost nothing in the state)\n",
		took.Round(time.Millisecond), mibOf(s.StateBytes), mibOf(s.Bytes), memory>>20, float64(touched)/(1<<20))

	var restores, boots []time.Duration
	for i := 0; i < rounds; i++ {
		restores = append(restores, timed(d, "vm", "restore", "snapbench", "base"))
		d.Must("vm", "stop", "--force", "snapbench")
		boots = append(boots, timed(d, "vm", "start", "snapbench"))
	}
	r, b := median(restores), median(boots)
	fmt.Printf("  restore to agent-ready, median of %d: %s (min %s, max %s); cold boot of the same VM, alternating: %s (min %s, max %s)\n",
		rounds, r.Round(time.Millisecond), minDur(restores).Round(time.Millisecond), maxDur(restores).Round(time.Millisecond),
		b.Round(time.Millisecond), minDur(boots).Round(time.Millisecond), maxDur(boots).Round(time.Millisecond))
	fmt.Printf("  restore / cold boot: %.2fx (target <= 0.2x)\n", float64(r)/float64(b))

	// Forks of a warm VM: one from a snapshot taken now, the rest from
	// "base"; their memory against as many cold boots.
	d.Must("exec", "snapbench", "--", "true")
	var forkNow time.Duration
	var fromSnap []time.Duration
	var names []string
	for i := 0; i < forks; i++ {
		name := fmt.Sprintf("snapfork%d", i)
		if i == 0 {
			forkNow = timed(d, "vm", "fork", "snapbench", name)
		} else {
			fromSnap = append(fromSnap, timed(d, "vm", "fork", "snapbench", name, "--snapshot", "base"))
		}
		names = append(names, name)
	}
	fmt.Printf("  fork of a running VM (snapshot now, then fork) to agent-ready: %s; from an existing snapshot, median of %d: %s\n",
		forkNow.Round(time.Millisecond), len(fromSnap), median(fromSnap).Round(time.Millisecond))
	var cold []string
	for i := 0; i < forks; i++ {
		name := fmt.Sprintf("snapcold%d", i)
		d.Must("vm", "create", name, "--memory", "256M", "--cpus", "1")
		cold = append(cold, name)
	}
	f, c := sum(qemuPSSAll(t, d, names)), sum(qemuPSSAll(t, d, cold))
	fmt.Printf("  host memory (QEMU PSS, summed): %d forks %.1f MiB, %d cold boots %.1f MiB (%.2fx): each fork holds its own copy of the saved state's pages (zero pages are not loaded), a cold boot what booting touched\n",
		forks, f, forks, c, f/c)
	for _, name := range append(names, cold...) {
		d.Must("vm", "rm", "--force", name)
	}
	d.Must("vm", "snapshot", "rm", "snapbench", "fork-snapfork0")
}

func minDur(d []time.Duration) time.Duration {
	m := d[0]
	for _, v := range d {
		m = min(m, v)
	}
	return m
}

func maxDur(d []time.Duration) time.Duration {
	m := d[0]
	for _, v := range d {
		m = max(m, v)
	}
	return m
}
