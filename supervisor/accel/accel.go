// Package accel picks the QEMU accelerator for this host, and the CPU
// model a guest gets under it (QEMUCPU, TCGHiddenFeatures).
//
// KVM is used only when /dev/kvm opens read-write *and* the CPU advertises
// hardware virtualization (vmx or svm). Some hosts expose /dev/kvm without
// either flag (nested setups without VMX passthrough); a stock kernel hangs
// under KVM there, so such hosts get TCG.
package accel

import (
	"bufio"
	"io"
	"os"
	"strings"
)

// Accelerator names as QEMU spells them.
const (
	KVM = "kvm"
	TCG = "tcg"
)

// Choice is the accelerator and why it was picked.
type Choice struct {
	Name   string
	Reason string
}

// Detect inspects the host. It never fails: anything unusual means TCG.
func Detect() Choice {
	return detect("/dev/kvm", "/proc/cpuinfo")
}

func detect(kvmPath, cpuinfoPath string) Choice {
	f, err := os.OpenFile(kvmPath, os.O_RDWR, 0)
	if err != nil {
		return Choice{TCG, "/dev/kvm is not usable: " + err.Error()}
	}
	f.Close()
	ci, err := os.Open(cpuinfoPath)
	if err != nil {
		return Choice{TCG, "cannot read cpu flags: " + err.Error()}
	}
	defer ci.Close()
	if !hasVirtFlag(ci) {
		return Choice{TCG, "/dev/kvm exists but the CPU reports neither vmx nor svm"}
	}
	return Choice{KVM, "/dev/kvm is usable and the CPU reports hardware virtualization"}
}

func hasVirtFlag(r io.Reader) bool {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		key, val, ok := strings.Cut(sc.Text(), ":")
		if !ok || strings.TrimSpace(key) != "flags" {
			continue
		}
		for _, f := range strings.Fields(val) {
			if f == "vmx" || f == "svm" {
				return true
			}
		}
	}
	return false
}

// TCGHiddenFeatures are the CPU features of QEMU's "max" model that a
// guest under TCG is not told about, because TCG runs the code a guest
// picks for them far slower than the code it picks without them.
//
//   - erms (enhanced REP MOVSB/STOSB): with it, Linux copies between
//     user and kernel memory and clears pages with REP MOVSB and REP
//     STOSB, and Go's memmove and glibc's memcpy use REP MOVSB for large
//     copies. TCG runs a REP string instruction one element per pass, so
//     these move one byte per pass where REP MOVSQ, which the guest uses
//     without erms, moves eight. Under TCG, in a 1-vCPU guest on the
//     development machine, hiding it took reading a 64 MiB tmpfs file
//     from 210 to 80 ms, reading 256 MiB of /dev/zero from 600 to 105 ms,
//     and carrel's file uploads and downloads from 39-43 to 60-68 and
//     from 76-83 to 145-147 MiB/s (docs/operator-guide.md, "Accelerator
//     and devices").
//
// The features are optional: every x86-64 guest runs without them. Under
// KVM the guest gets the host's CPU as it is.
var TCGHiddenFeatures = []string{"erms"}

// QEMUCPU is the -cpu value for a guest under acc: the host's CPU under
// KVM; under TCG, "max" without TCGHiddenFeatures.
func QEMUCPU(acc string) string {
	if acc == KVM {
		return "host"
	}
	cpu := "max"
	for _, f := range TCGHiddenFeatures {
		cpu += "," + f + "=off"
	}
	return cpu
}
