// Package accel picks the QEMU accelerator for this host.
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
