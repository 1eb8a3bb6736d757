package main

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/carrel-os/carrel/image/store"
	"github.com/carrel-os/carrel/supervisor/driver/libvirt/libvirttest"
	"github.com/carrel-os/carrel/tests/harness"
)

// libvirtDaemon starts a second carreld, with the libvirt driver, and
// builds the dev image in its store; nil, and why, when this host has no
// libvirtd to be had (not installed, or not root).
func libvirtDaemon(t *tb, digest string) (*harness.Daemon, string) {
	if err := libvirttest.Ensure(); errors.Is(err, libvirttest.ErrUnavailable) {
		return nil, err.Error()
	} else if err != nil {
		t.Fatal(err)
	}
	d := harness.New(t, "--driver", "libvirt", "--libvirt-uri", harness.LibvirtURI)
	d.Start()
	if got := d.BuildImage(); got != digest {
		// The dev image build is reproducible; a different digest would
		// mean the two carrelds boot different images.
		t.Fatalf("the libvirt carreld built image %s, the other %s: not the same image", got, digest)
	}
	return d, ""
}

// benchBoot times `carrel vm create` to agent-ready through the qemu
// driver (d) and through the libvirt driver (lv; nil to leave it out),
// against bare qemu-system-x86_64 booting the same kernel and initrd with
// the same devices to the agent's ready marker on the serial port. Each
// round boots all three, in an order that rotates from round to round, so
// that drift in the host's load falls on each alike.
func benchBoot(t *tb, d, lv *harness.Daemon, img *store.Resolved, machine string, rounds int) {
	kinds := []string{"qemu driver", "libvirt driver", "bare qemu"}
	boot := map[string]func(name string) time.Duration{
		"qemu driver": func(name string) time.Duration {
			start := time.Now()
			d.Must("vm", "create", name, "--memory", "512M", "--cpus", "1")
			took := time.Since(start)
			d.Must("vm", "rm", "--force", name)
			return took
		},
		"libvirt driver": func(name string) time.Duration {
			start := time.Now()
			lv.Must("vm", "create", name, "--memory", "512M", "--cpus", "1")
			took := time.Since(start)
			lv.Must("vm", "rm", "--force", name)
			return took
		},
		"bare qemu": func(string) time.Duration {
			took, err := bareBoot(machine, img, 512)
			if err != nil {
				t.Fatal(err)
			}
			return took
		},
	}
	note := ""
	if lv == nil {
		kinds = []string{"qemu driver", "bare qemu"}
	} else if machine != "q35" {
		note = " (libvirt's domains are q35 whatever -machine says)"
	}
	fmt.Printf("\nboot to agent-ready, 512 MiB, 1 vCPU, machine %s%s, %d rounds of each, order rotating:\n", machine, note, rounds)
	// libvirtd is shared: names unique to this run keep clear of domains
	// another run left.
	var b [3]byte
	rand.Read(b[:])
	suffix := hex.EncodeToString(b[:])
	times := map[string][]time.Duration{}
	for i := 0; i < rounds; i++ {
		var line []string
		for j := range kinds {
			k := kinds[(i+j)%len(kinds)]
			took := boot[k](fmt.Sprintf("boot%d-%s", i, suffix))
			times[k] = append(times[k], took)
			line = append(line, fmt.Sprintf("%s %v", k, took.Round(time.Millisecond)))
		}
		fmt.Printf("  round %d: %s\n", i+1, strings.Join(line, ", "))
	}
	mq, mb := median(times["qemu driver"]), median(times["bare qemu"])
	ratio := float64(mq) / float64(mb)
	if lv == nil {
		fmt.Printf("boot median: qemu driver %v, bare qemu %v; ratio qemu driver/bare %.3f (target <= 1.05: %s)\n",
			mq.Round(time.Millisecond), mb.Round(time.Millisecond), ratio, verdict(ratio <= 1.05))
		return
	}
	ml := median(times["libvirt driver"])
	fmt.Printf("boot median: qemu driver %v, libvirt driver %v, bare qemu %v\n",
		mq.Round(time.Millisecond), ml.Round(time.Millisecond), mb.Round(time.Millisecond))
	fmt.Printf("ratios: qemu driver/bare %.3f (target <= 1.05: %s), libvirt driver/bare %.3f, libvirt driver/qemu driver %.3f (libvirt's own overhead: %+v)\n",
		ratio, verdict(ratio <= 1.05), float64(ml)/float64(mb), float64(ml)/float64(mq), (ml - mq).Round(time.Millisecond))
}
