package qemu

import (
	"fmt"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/accel"
	"github.com/carrel-os/carrel/supervisor/driver"
)

// Machine types the driver can boot.
const (
	// MachineMicroVM has no PCI bus and no firmware to speak of: virtio
	// devices sit on MMIO. It boots fastest.
	MachineMicroVM = "microvm"
	// MachineQ35 is a standard PC with PCIe, for guests that need PCI
	// (e.g. VFIO passthrough).
	MachineQ35 = "q35"
	// MachineAuto picks by accelerator: see DefaultMachine.
	MachineAuto = "auto"
)

// Socket and file names inside a VM's directory.
const (
	qmpSocketName     = "qmp.sock"
	agentSocketName   = "agent.sock"
	dataSocketName    = "data.sock"
	consoleSocketName = "console.sock"
	logFileName       = "qemu.log"
	pidFileName       = "qemu.pid"
	vfioFileName      = "vfio-moved"
)

// File descriptors of the pre-opened listening sockets in the QEMU process
// (os/exec's ExtraFiles start at 3).
const (
	fdQMP = 3 + iota
	fdAgent
	fdConsole
	fdData // unless Spec.NoDataPort
)

// fdIncoming is the descriptor of the saved state a VM starts from
// (Spec.Incoming): the one after the sockets'.
func fdIncoming(spec driver.Spec) int {
	if spec.NoDataPort {
		return fdData
	}
	return fdData + 1
}

// maxSocketPath is sun_path's size less its terminating NUL.
const maxSocketPath = 107

// layout is where a VM's sockets live.
type layout struct {
	qmp, agent, data, console, log, pidfile string
	// vfio lists the devices a start may have moved to vfio-pci (vfio.go).
	vfio string
}

func newLayout(dir string) (layout, error) {
	l := layout{
		qmp:     filepath.Join(dir, qmpSocketName),
		agent:   filepath.Join(dir, agentSocketName),
		data:    filepath.Join(dir, dataSocketName),
		console: filepath.Join(dir, consoleSocketName),
		log:     filepath.Join(dir, logFileName),
		pidfile: filepath.Join(dir, pidFileName),
		vfio:    filepath.Join(dir, vfioFileName),
	}
	for _, p := range []string{l.qmp, l.agent, l.data, l.console} {
		if len(p) > maxSocketPath {
			return layout{}, fmt.Errorf("socket path %q is longer than %d bytes: use a shorter state dir", p, maxSocketPath)
		}
	}
	return l, nil
}

// args builds the qemu-system-x86_64 command line. carreld creates the
// listening sockets itself and passes them as file descriptors, so they can
// be connected to before QEMU has even started, and the VM starts paused
// (-S) so that nothing the guest prints or sends is missed.
func args(spec driver.Spec, machine string, acc string, l layout) []string {
	var machineOpt, serialDev, vsockDev, blockDev string
	switch machine {
	case MachineQ35:
		machineOpt = "q35,accel=" + acc
		serialDev = "virtio-serial-pci,id=vser0"
		vsockDev = "vhost-vsock-pci"
		blockDev = "virtio-blk-pci"
	default:
		// Keep microvm's legacy PIT and PIC: under TCG the kernel needs the
		// PIT to calibrate the TSC, and hangs without it.
		machineOpt = "microvm,accel=" + acc
		serialDev = "virtio-serial-device,id=vser0"
		vsockDev = "vhost-vsock-device"
		blockDev = "virtio-blk-device"
	}
	cmdline := spec.Cmdline
	if machine != MachineQ35 && !hasParam(cmdline, "reboot") {
		// microvm has neither a keyboard controller nor an ACPI reset
		// register: only a triple fault resets it, and without one a
		// panicking guest (panic=-1) spins instead of letting QEMU exit.
		cmdline = strings.TrimSpace(cmdline + " reboot=t")
	}
	if acc == accel.TCG && !hasParam(cmdline, "tsc") {
		// Under TCG every vCPU's TSC is QEMU's reading of the host's, so
		// they agree; but with two or more vCPUs the kernel cannot prove it,
		// marks the TSC unstable and falls back to the HPET. The vDSO cannot
		// read the HPET, so every clock read (the Go runtime makes many)
		// becomes a system call plus an emulated MMIO read.
		cmdline = strings.TrimSpace(cmdline + " tsc=reliable")
	}
	a := []string{
		"-name", "carrel-" + spec.Name + ",debug-threads=on",
		"-machine", machineOpt,
		"-cpu", accel.QEMUCPU(acc),
		"-m", strconv.FormatUint(spec.MemoryBytes>>20, 10) + "M",
		"-smp", strconv.FormatUint(uint64(spec.CPUs), 10),
		"-nodefaults", "-no-user-config", "-display", "none",
		"-no-reboot",
		"-kernel", spec.Kernel,
		"-initrd", spec.Initrd,
		"-append", cmdline,
		"-chardev", "socket,id=console,fd=" + strconv.Itoa(fdConsole) + ",server=on,wait=off",
		"-serial", "chardev:console",
		"-device", serialDev,
		"-chardev", "socket,id=agent,fd=" + strconv.Itoa(fdAgent) + ",server=on,wait=off",
		"-device", "virtserialport,bus=vser0.0,chardev=agent,name=" + protocol.SerialPortName,
	}
	if !spec.NoDataPort {
		a = append(a,
			"-chardev", "socket,id=data,fd="+strconv.Itoa(fdData)+",server=on,wait=off",
			"-device", "virtserialport,bus=vser0.0,chardev=data,name="+protocol.DataPortName)
	}
	a = append(a,
		"-chardev", "socket,id=qmp,fd="+strconv.Itoa(fdQMP)+",server=on,wait=off",
		"-mon", "chardev=qmp,mode=control",
		// QEMU's seccomp filter: no new privileges, no spawning helpers.
		"-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
		"-S",
	)
	if spec.Incoming != nil {
		a = append(a, "-incoming", "fd:"+strconv.Itoa(fdIncoming(spec)))
	}
	if spec.CID != 0 {
		a = append(a, "-device", vsockDev+",guest-cid="+strconv.FormatUint(uint64(spec.CID), 10))
	}
	for i, d := range spec.Disks {
		id := "disk" + strconv.Itoa(i)
		drive := "if=none,id=" + id + ",format=" + d.Format + ",file=" + strings.ReplaceAll(d.Path, ",", ",,")
		// A qcow2 disk names its backing file and that file's format
		// (image/workspace.Create), which QEMU opens read-only.
		if d.ReadOnly {
			drive += ",readonly=on"
		} else {
			drive += ",discard=unmap"
		}
		a = append(a, "-drive", drive, "-device", blockDev+",drive="+id+",serial="+d.Serial)
	}
	return a
}

// hasParam reports whether the kernel command line sets name.
func hasParam(cmdline, name string) bool {
	for _, f := range strings.Fields(cmdline) {
		if k, _, _ := strings.Cut(f, "="); k == name {
			return true
		}
	}
	return false
}
