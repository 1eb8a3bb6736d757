package main

// Host memory per VM and carreld's own size: n VMs booted by carreld, then
// each QEMU's proportional set size (PSS, /proc/PID/smaps) split into the
// guest's RAM block and everything else (QEMU's code and heap, device
// emulation, and under TCG the translation cache), and carreld's resident
// set with all of them running.

import (
	"bufio"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/carrel-os/carrel/tests/harness"
)

// qemuPSS returns a QEMU's PSS in bytes, and the PSS of its guest RAM: the
// anonymous mapping exactly guestRAM bytes long (QEMU allocates each RAM
// block as one mapping).
func qemuPSS(pid int, guestRAM uint64) (total, ram uint64, err error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	var size uint64
	for sc.Scan() {
		line := sc.Text()
		fields := strings.Fields(line)
		if len(fields) >= 5 && strings.Contains(fields[0], "-") && !strings.HasSuffix(fields[0], ":") {
			// A mapping's header: "start-end perms offset dev inode [path]".
			se := strings.SplitN(fields[0], "-", 2)
			start, err1 := strconv.ParseUint(se[0], 16, 64)
			end, err2 := strconv.ParseUint(se[1], 16, 64)
			size = 0
			if err1 == nil && err2 == nil && len(fields) == 5 {
				size = end - start // anonymous: no path
			}
			continue
		}
		if len(fields) == 3 && fields[0] == "Pss:" {
			kb, err := strconv.ParseUint(fields[1], 10, 64)
			if err != nil {
				return 0, 0, err
			}
			total += kb << 10
			if size == guestRAM {
				ram += kb << 10
			}
		}
	}
	return total, ram, sc.Err()
}

// rss returns a process's resident set in bytes.
func rss(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10, err
		}
	}
	return 0, fmt.Errorf("no VmRSS for %d", pid)
}

func benchOverhead(t *tb, d *harness.Daemon, n int) {
	const memory = 256 << 20
	fmt.Printf("\nhost memory with %d VMs (qemu driver, %d MiB, 1 vCPU each), booted one after another:\n", n, memory>>20)
	before, err := rss(d.Pid())
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for i := 0; i < n; i++ {
		name := fmt.Sprintf("mem%d", i)
		d.Must("vm", "create", name, "--memory", "256M", "--cpus", "1")
		d.Must("exec", name, "--", "true")
		names = append(names, name)
	}
	defer func() {
		for _, name := range names {
			d.Must("vm", "rm", "--force", name)
		}
	}()
	var overheads, totals, rams []float64
	for _, name := range names {
		total, ram, err := qemuPSS(qemuPid(t, d, name), memory)
		if err != nil {
			t.Fatal(err)
		}
		totals = append(totals, float64(total)/(1<<20))
		rams = append(rams, float64(ram)/(1<<20))
		overheads = append(overheads, float64(total-ram)/(1<<20))
	}
	after, err := rss(d.Pid())
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(overheads)
	fmt.Printf("  per QEMU, median: PSS %.1f MiB, of which guest RAM touched %.1f MiB (of %d MiB); PSS minus guest RAM %.1f MiB (min %.1f, max %.1f)\n",
		medianFloat(totals), medianFloat(rams), memory>>20, medianFloat(overheads), overheads[0], overheads[len(overheads)-1])
	fmt.Printf("  (PSS minus the whole %d MiB of guest RAM would be %.1f MiB: a guest touches only part of its RAM)\n",
		memory>>20, medianFloat(totals)-float64(memory>>20))
	fmt.Printf("  carreld RSS: %.1f MiB with no VM, %.1f MiB with %d VMs running\n", float64(before)/(1<<20), float64(after)/(1<<20), n)
}
