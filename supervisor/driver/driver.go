// Package driver defines how carreld runs a VM, independent of the
// hypervisor front end (straight QEMU, or libvirt).
//
// A driver is composed of small interfaces, as Lima's is: a Lifecycle to
// boot and end the VM, and dialers for the streams carreld needs into it.
package driver

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
)

// ErrNotRunning means the VM's process is gone.
var ErrNotRunning = errors.New("vm is not running")

// Spec describes a VM to boot.
type Spec struct {
	Name        string
	Kernel      string
	Initrd      string
	Cmdline     string
	MemoryBytes uint64
	CPUs        uint32
	// Dir holds the VM's sockets and pid file. It must exist.
	Dir string
	// CID is the guest's vsock context id; 0 means no vsock device.
	CID uint32
	// Disks are attached as virtio disks, in order; the guest finds each
	// by its serial. carreld gives a VM its image's verified root and hash
	// device (read-only, shared by every VM of the image), its writable
	// layer and its workspace (qcow2 over a template).
	Disks []Disk
	// Driver names the driver that runs the VM (a Set routes by it); ""
	// means the Set's default. A VM keeps the driver it was created with.
	Driver string
	// GPUs are the PCI addresses of GPUs to pass through, vetted when the
	// VM was created. The driver passes each with the other functions of
	// its slot (supervisor/gpu.Host.Check plans them), bound to vfio-pci.
	GPUs []string
	// Incoming, when set, is a state saved by Snapshotter.SaveState, read
	// from its start: the VM starts from it instead of booting, and Start
	// returns once it is loaded, the vCPUs stopped. The caller keeps the
	// file and closes it after Start. Only a Snapshotter takes it.
	Incoming *os.File
	// NoDataPort leaves out the data port (protocol.DataPortName). Set it
	// with an Incoming state saved from a VM without one (its
	// Instance.DataSocket empty): QEMU loads a state only into a
	// virtio-serial device with the saved ports. On a restore the libvirt
	// driver takes the ports of the saved domain instead.
	NoDataPort bool
}

// Disk formats.
const (
	FormatRaw   = "raw"
	FormatQCOW2 = "qcow2"
)

// Disk is one virtio disk of a VM.
type Disk struct {
	// Path is the disk's file, in Format.
	Path   string
	Format string
	// Backing is a qcow2 disk's backing file, raw and opened read-only;
	// the qcow2 file records it with its format, and the libvirt driver
	// spells the chain out too, so that no format is ever probed.
	Backing string
	// Layers are the frozen qcow2 files between Path and Backing, nearest
	// first: the disk layers of the snapshots the disk stands on. Each
	// records the file under it and its format; QEMU reads them from
	// there, libvirt from the domain's XML.
	Layers []string
	// ReadOnly disks are attached read-only; one file may then serve
	// many VMs at once.
	ReadOnly bool
	// Serial is the disk's virtio serial (at most 20 bytes).
	Serial string
}

// Instance is what a driver needs to find a running VM again, e.g. after
// carreld restarts. It is persisted in the VM's record.
type Instance struct {
	Driver string `json:"driver"`
	PID    int    `json:"pid"`
	// StartTime is the process start time in clock ticks since boot
	// (/proc/PID/stat field 22); it tells a reused pid from ours.
	StartTime   uint64 `json:"start_time"`
	QMPSocket   string `json:"qmp_socket"`
	AgentSocket string `json:"agent_socket"`
	// DataSocket is the host end of the data port; "" when the VM has
	// none (it started before the port existed, or from a state saved
	// without one).
	DataSocket    string `json:"data_socket,omitempty"`
	ConsoleSocket string `json:"console_socket"`
	CID           uint32 `json:"cid,omitempty"`
	Accelerator   string `json:"accelerator"`
	// Cgroup is the cgroup v2 group the VM's QEMU runs in, if it has one.
	Cgroup string `json:"cgroup,omitempty"`
	// Domain and DomainUUID name the libvirt domain (libvirt driver only).
	// A transient domain gets a new UUID at every start, so a record can
	// never match a later domain of the same name.
	Domain     string `json:"domain,omitempty"`
	DomainUUID string `json:"domain_uuid,omitempty"`
	// VFIO are the PCI devices the qemu driver moved to vfio-pci for the
	// VM; Kill gives them back to their host drivers.
	VFIO []string `json:"vfio,omitempty"`
	// UID is the user the qemu driver's jail runs QEMU as; 0 when QEMU
	// runs as carreld's user.
	UID uint32 `json:"uid,omitempty"`
}

// Lifecycle boots and ends VMs.
type Lifecycle interface {
	// Start launches the VM with its vCPUs paused, so that carreld can attach
	// to the console and agent streams before the guest runs. On error
	// nothing is left running.
	Start(ctx context.Context, spec Spec) (Instance, error)
	// Resume starts the vCPUs of a VM launched by Start.
	Resume(ctx context.Context, inst Instance) error
	// Pause stops the vCPUs of a running VM; Resume starts them again.
	// carreld pauses every VM while its audit log cannot be written.
	Pause(ctx context.Context, inst Instance) error
	// Adopt checks that inst is still our VM, running, and reports whether
	// its vCPUs are stopped; it changes neither. It returns ErrNotRunning
	// when the process is gone or the pid was reused.
	Adopt(ctx context.Context, inst Instance) (paused bool, err error)
	// Wait blocks until the VM's process has exited or ctx ends.
	Wait(ctx context.Context, inst Instance) error
	// Kill ends the VM at once (QMP quit, then SIGKILL). It returns nil if
	// the VM is already gone.
	Kill(ctx context.Context, inst Instance) error
	// Sweep kills a VM process that a Start in dir left running without
	// returning its Instance (carreld died during Start). It returns nil
	// when there is none.
	Sweep(ctx context.Context, dir string) error
}

// Dialer opens a new stream.
type Dialer func(ctx context.Context) (net.Conn, error)

// Streams opens the host ends of a VM's byte streams.
type Streams interface {
	// AgentDialer returns how to reach the guest agent: vsock when the VM
	// has a CID, else its virtio-serial port.
	AgentDialer(inst Instance) (dial Dialer, transport string)
	// ConsoleDialer returns how to read the VM's serial console.
	ConsoleDialer(inst Instance) Dialer
}

// ErrUnsupported is returned by a driver asked for something it cannot do.
var ErrUnsupported = errors.New("not supported by this driver")

// Snapshotter saves a running VM's state: with its vCPUs stopped, its
// disks are frozen (FreezeDisks) and its memory and device state saved
// (SaveState), so that both are of one instant. Spec.Incoming starts a VM
// from such a state.
type Snapshotter interface {
	// FreezeDisks moves each writable disk of inst, named by the file it
	// has open now, to a new qcow2 overlay at the paired path, whose
	// backing is that file; QEMU then writes only the overlay, and the
	// file stays as it was. All disks move or none. The vCPUs must be
	// stopped.
	FreezeDisks(ctx context.Context, inst Instance, overlays map[string]string) error
	// SaveState writes inst's memory and device state to a new file at
	// path, at most max bytes (else ErrStateTooLarge), and returns its
	// size. The vCPUs must be stopped; Resume starts them again. The
	// caller syncs the file.
	SaveState(ctx context.Context, inst Instance, path string, max int64) (int64, error)
}

// DiskFiles is what a driver can say of a running VM's disks: the files
// they have open now. A carreld that died during FreezeDisks asks it to
// know whether the disks moved. A driver whose FreezeDisks moves the disks
// in the same step as it makes the overlays (the qemu driver: QEMU makes
// them) need not have it.
type DiskFiles interface {
	// OpenDiskFiles returns the file of each disk inst has open.
	OpenDiskFiles(ctx context.Context, inst Instance) ([]string, error)
}

// ErrDisksUnknown is a FreezeDisks that failed without the driver knowing
// whether the disks moved (the hypervisor stopped answering): the
// overlays are left in place, for the caller to settle once it can ask
// (DiskFiles).
var ErrDisksUnknown = errors.New("the driver cannot tell whether the disks moved")

// ErrStateTooLarge is a saved state over the bound its caller set.
var ErrStateTooLarge = errors.New("the saved state is larger than the vm's memory allows")

// LimitWriter passes at most max bytes to w; a write past them fails
// with ErrStateTooLarge and passes nothing.
func LimitWriter(w io.Writer, max int64) io.Writer { return &limitWriter{w: w, left: max} }

type limitWriter struct {
	w    io.Writer
	left int64
}

func (l *limitWriter) Write(p []byte) (int, error) {
	if int64(len(p)) > l.left {
		return 0, ErrStateTooLarge
	}
	l.left -= int64(len(p))
	return l.w.Write(p)
}

// Driver is a complete VM back end.
type Driver interface {
	Name() string
	Lifecycle
	Streams
}
