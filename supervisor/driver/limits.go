package driver

import "github.com/carrel-os/carrel/supervisor/accel"

// The host-side limits both drivers put on a VM's QEMU, from the VM's
// size: the qemu driver writes them to its cgroup v2 group, the libvirt
// driver hands them to libvirt (<memtune>, <cputune>), which sets them on
// the domain's cgroup.

// QEMUOverhead is the memory a QEMU may use beyond its guest's RAM:
// device emulation, and under TCG the translation cache (QEMU's default
// tb-size is 1 GiB).
func QEMUOverhead(acc string) uint64 {
	if acc == accel.KVM {
		return 512 << 20
	}
	return (1 << 30) + (512 << 20)
}

// HostMemoryLimit is the most memory a QEMU running a guest of guestBytes
// under accelerator acc may use, in bytes.
func HostMemoryLimit(guestBytes uint64, acc string) uint64 {
	return guestBytes + QEMUOverhead(acc)
}

// CPUPeriod is the CPU bandwidth period of the limits, in µs.
const CPUPeriod = 100000

// CPUQuota is the CPU time, in µs per CPUPeriod, that a QEMU with cpus
// vCPUs may use: the vCPUs, and one CPU more for QEMU's main loop and I/O.
func CPUQuota(cpus uint32) uint64 {
	return (uint64(cpus) + 1) * CPUPeriod
}
