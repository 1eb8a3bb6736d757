// Package protocol holds what carreld and carrel-agent must agree on to talk:
// where the agent listens, how large a message may be, and the HTTP/2 settings
// that carry connect RPCs over a single vsock or virtio-serial stream. It also
// holds what carreld and its clients share: the Carrel-Vm header and the rule
// for VM names.
//
// Both ends speak connect (gRPC protocol) over cleartext HTTP/2. HTTP/2 gives
// multiplexing and flow control over one byte stream, which is all a
// virtio-serial port offers; vsock gets the same framing so that there is one
// protocol to test and fuzz.
//
// On a virtio-serial VM, file content crosses a second port beside the
// stream, the data port, in the frames of bulk.go: each read of a port
// returns one 4 KiB buffer, and content there costs the guest no HTTP/2 or
// protobuf work. The RPC that moves it names the transfer.
package protocol

import (
	"context"
	"net"
	"net/http"
	"time"

	"connectrpc.com/connect"
)

// VMHeader names, on carreld's API, the VM that a relayed agent call
// (carrel.agent.v1's files, processes and ports) is for.
const VMHeader = "Carrel-Vm"

// HoldEventsHeader, set to "1" on a Commands call, tells the agent that
// the host reads CommandsOutput.held: the agent may then hold a young
// command's events back (EventHold) and send them together. An agent
// whose host does not send it sends each event as a message of its own.
const HoldEventsHeader = "Carrel-Hold-Events"

const (
	// VsockPort is the AF_VSOCK port the agent listens on.
	VsockPort = 1024

	// SerialPortName is the name of the virtserialport the host exposes; the
	// guest finds it under /sys/class/virtio-ports/*/name.
	SerialPortName = "org.carrel.agent.0"
	// DataPortName is the virtserialport that carries bulk file data
	// beside the agent port, in the frames of bulk.go: a port reads at most
	// one 4 KiB buffer per call, so the guest moves file content through
	// it with plain reads and writes, not through HTTP/2 and protobuf.
	DataPortName = "org.carrel.data.0"

	// WorkspaceSerial is the serial of the VM's workspace disk (a virtio
	// block device); the guest finds it under /sys/block/*/serial when the
	// kernel command line has WorkspaceDiskArg.
	WorkspaceSerial = "carrel-workspace"
	// SystemSerial and SystemVeritySerial are the serials of an image's
	// read-only root file system (erofs) and its dm-verity hash device;
	// StateSerial is the VM's own disk that holds the writable layer over
	// that root. virtio-blk serials are at most 20 bytes.
	SystemSerial       = "carrel-system"
	SystemVeritySerial = "carrel-system-verity"
	StateSerial        = "carrel-state"
	// DiskByIDPrefix is where udev would name a virtio disk by its serial;
	// the verity words of the command line use these names (systemd's
	// convention), and the agent, without udev, maps them back to serials.
	DiskByIDPrefix = "/dev/disk/by-id/virtio-"
	// StateArg on the kernel command line says where the writable layer
	// over a verified root lives: StateDisk (the state disk) or StateMemory
	// (a tmpfs: the VM's changes are lost at stop).
	StateArg    = "carrel.state"
	StateDisk   = "disk"
	StateMemory = "memory"

	// WorkspaceDiskArg on the kernel command line tells the guest that its
	// /workspace is on the workspace disk; without it /workspace is a
	// tmpfs.
	WorkspaceDiskArg = "carrel.workspace=disk"

	// MaxMessageBytes caps a single protobuf message in either direction.
	MaxMessageBytes = 1 << 20

	// MaxFrameBytes caps one HTTP/2 frame: a whole message, so that a
	// large transfer costs the guest one frame header read and one window
	// update per message rather than per 64 KiB (under TCG each costs a
	// syscall and, for the update, a trip through QEMU).
	MaxFrameBytes = MaxMessageBytes

	// MaxStreamWindowBytes and MaxConnWindowBytes are the flow-control
	// windows each end grants: how much a peer may send before the
	// receiver has read it, and so the most either end buffers for one
	// stream and for the whole link. A stream's window holds several
	// whole frames, so a sender never waits for the last one to be read.
	MaxStreamWindowBytes = 4 << 20
	MaxConnWindowBytes   = 2 * MaxStreamWindowBytes

	// MaxHeaderBytes caps the HTTP/2 header block of one request or response.
	MaxHeaderBytes = 64 << 10

	// ExecChunkBytes is the largest output chunk the agent sends at once.
	ExecChunkBytes = 32 << 10

	// CommandCredit is the output credit each command on a Commands stream
	// starts with, in units: an event costs its encoded size plus
	// CommandEventOverhead. It is what the host buffers for a command whose
	// caller reads slowly, and holds several whole output chunks, so the
	// agent seldom waits for more. The host grants more as its caller takes
	// events, in grants of at least half of it.
	CommandCredit = 256 << 10

	// CommandEventOverhead is what each event costs in credit beyond its
	// size: it bounds how many tiny events the host may have to hold.
	CommandEventOverhead = 64

	// EventHold is how long after its start a command's events may be held
	// back on a Commands stream, to leave in one message with what follows
	// them; at most EventHoldBytes of them are. Under emulation each write
	// to a virtio-serial port costs the guest's CPU, and the HTTP/2 server
	// writes each message on its own, so a short command's start, output
	// and exit status cost one write instead of one each. A command that
	// runs longer sends what it holds when the hold ends, and its later
	// events at once.
	EventHold      = 10 * time.Millisecond
	EventHoldBytes = ExecChunkBytes

	// MaxCommands caps the commands running at once on a Commands stream,
	// as HTTP/2's MaxConcurrentStreams caps calls: carreld refuses the next
	// one, and so does the agent.
	MaxCommands = 1000

	// ReadyMarker is printed on the guest console once the agent serves. The
	// supervisor never waits on it (it waits on a Health RPC); it exists for
	// people reading the console and for the bare-QEMU benchmark baseline.
	ReadyMarker = "carrel-agent: ready"

	// BootFailedMarker starts the console line the agent prints when the
	// guest cannot boot (its verified root or workspace cannot be set up);
	// carreld quotes that line in the error of a failed create or start.
	BootFailedMarker = "carrel-agent: boot failed:"

	// BaseURL is the URL clients use; the host part is ignored by the dialer.
	BaseURL = "http://agent"

	// MaxExecID is the longest command id the agent gives out.
	MaxExecID = 64
)

// ValidExecID reports whether s can be a command id: 1 to MaxExecID of
// [0-9A-Za-z_-]. The agent names the cgroups it makes for commands by
// them, and the host checks the ids the guest reports with it.
func ValidExecID(s string) bool {
	if s == "" || len(s) > MaxExecID {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

// HTTP2 returns the HTTP/2 settings shared by both ends.
func HTTP2() *http.HTTP2Config {
	return &http.HTTP2Config{
		MaxConcurrentStreams:          1000,
		MaxReadFrameSize:              MaxFrameBytes,
		MaxReceiveBufferPerConnection: MaxConnWindowBytes,
		MaxReceiveBufferPerStream:     MaxStreamWindowBytes,
		// Keepalive: a peer that stops answering is noticed within ~20s.
		SendPingTimeout:  10 * time.Second,
		PingTimeout:      10 * time.Second,
		WriteByteTimeout: 10 * time.Second,
		// A virtio-serial port is a single stream: never dial a second one.
		StrictMaxConcurrentRequests: true,
	}
}

// Protocols returns cleartext HTTP/2 only (prior knowledge, no upgrade).
func Protocols() *http.Protocols {
	p := new(http.Protocols)
	p.SetUnencryptedHTTP2(true)
	return p
}

// NewHTTPClient returns a client whose every request runs over connections
// made by dial. At most one connection is open at a time.
func NewHTTPClient(dial func(ctx context.Context) (net.Conn, error)) (*http.Client, *http.Transport) {
	t := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return dial(ctx)
		},
		Protocols:              Protocols(),
		HTTP2:                  HTTP2(),
		MaxConnsPerHost:        1,
		MaxIdleConns:           1,
		MaxResponseHeaderBytes: MaxHeaderBytes,
		DisableCompression:     true,
	}
	return &http.Client{Transport: t}, t
}

// NewHTTPServer returns a server for h that speaks cleartext HTTP/2 only.
func NewHTTPServer(h http.Handler) *http.Server {
	return &http.Server{
		Handler:           h,
		Protocols:         Protocols(),
		HTTP2:             HTTP2(),
		MaxHeaderBytes:    MaxHeaderBytes,
		ReadHeaderTimeout: 10 * time.Second,
	}
}

// ClientOptions are the connect options every agent client uses.
// Compression is off: the link is a local stream, and gzip in the guest
// (under TCG especially) costs far more than the bytes it saves; it would
// also let a guest make the host inflate a small message into a large one.
func ClientOptions() []connect.ClientOption {
	return []connect.ClientOption{
		connect.WithGRPC(),
		connect.WithReadMaxBytes(MaxMessageBytes),
		connect.WithSendMaxBytes(MaxMessageBytes),
		connect.WithAcceptCompression("gzip", nil, nil),
	}
}

// HandlerOptions are the connect options the agent's handlers use; they
// neither accept nor send compressed messages.
func HandlerOptions() []connect.HandlerOption {
	return []connect.HandlerOption{
		connect.WithReadMaxBytes(MaxMessageBytes),
		connect.WithSendMaxBytes(MaxMessageBytes),
		connect.WithCompression("gzip", nil, nil),
	}
}
