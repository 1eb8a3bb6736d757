// Package transport provides the listeners carrel-agent serves on inside the
// guest: AF_VSOCK, filtered to the host's CID, and a virtio-serial port for
// hosts without vhost-vsock. Both yield plain net.Conns; the protocol on top
// is the same.
package transport
