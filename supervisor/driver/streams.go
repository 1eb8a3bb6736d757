package driver

import (
	"context"
	"net"

	"github.com/mdlayher/vsock"

	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// SocketStreams implements Streams for VMs whose agent port and serial
// console are unix sockets on the host, and whose agent is reached over
// vsock instead when the VM has a CID. Both drivers embed it.
type SocketStreams struct{}

// AgentDialer implements Streams.
func (SocketStreams) AgentDialer(inst Instance) (Dialer, string) {
	if inst.CID != 0 {
		return func(ctx context.Context) (net.Conn, error) {
			// Dialling the VM's own CID is the host-side peer check: only
			// that guest can answer on it.
			return vsock.Dial(inst.CID, protocol.VsockPort, nil)
		}, "vsock"
	}
	return unixDialer(inst.AgentSocket), "virtio-serial"
}

// DataDialer returns how to reach the guest's data port, which carries
// bulk file data beside the agent port on virtio-serial VMs; nil when the
// VM has a CID (its agent is on vsock) or no data port.
func DataDialer(inst Instance) Dialer {
	if inst.CID != 0 || inst.DataSocket == "" {
		return nil
	}
	return unixDialer(inst.DataSocket)
}

// ConsoleDialer implements Streams.
func (SocketStreams) ConsoleDialer(inst Instance) Dialer {
	return unixDialer(inst.ConsoleSocket)
}

func unixDialer(path string) Dialer {
	return func(ctx context.Context) (net.Conn, error) {
		var nd net.Dialer
		return nd.DialContext(ctx, "unix", path)
	}
}
