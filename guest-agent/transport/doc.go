// Package transport provides the listeners carrel-agent serves on inside the
// guest: AF_VSOCK, filtered to the host's CID, and a virtio-serial port for
// hosts without vhost-vsock. Both yield plain net.Conns; the protocol on top
// is the same. A port's small writes are queued and merged (portWriter),
// since each write to a port costs an emulated guest a round trip through
// the hypervisor; before it writes, the ready goroutines run, so the frames
// of one answer (a unary call's message and its trailers) leave together.
// The caller's write deadlines bound only its wait for the
// queue; a write to the port fails when the port takes nothing for 10 s.
//
// DataPort is the guest's end of the data port, a second virtio-serial
// port for file content in frames (protocol/bulk.go), read into one
// buffer and written to the file, or the reverse, with no HTTP/2 between.
package transport
