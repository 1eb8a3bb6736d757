//go:build linux

package activity

import (
	"encoding/binary"
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// The kernel's process events connector (linux/cn_proc.h): every fork and
// exit in the system, as it happens. The fork of a process is sent before
// it first runs, so by the time the fanotify event of anything it did has
// been read, its fork is in the socket's queue.
const (
	cnIdxProc         = 1 // CN_IDX_PROC
	cnValProc         = 1 // CN_VAL_PROC
	procCnMcastListen = 1 // PROC_CN_MCAST_LISTEN
	procEventFork     = 0x00000001
	procEventExit     = 0x80000000

	nlmsgHdrBytes   = 16 // struct nlmsghdr
	cnMsgBytes      = 20 // struct cn_msg
	procEventHeader = 16 // what, cpu, timestamp_ns
	// connRcvBuf is the socket's receive buffer: a burst of forks larger
	// than this before the agent reads is lost (and counted).
	connRcvBuf = 4 << 20
	// maxDrain bounds the messages read in one drain, so that a fork storm
	// cannot keep the agent from its other work.
	maxDrain = 8192
)

// procEvent is a fork or an exit.
type procEvent struct {
	fork bool
	// For a fork: the new process's thread and group, and its parent's
	// group. For an exit: the thread and its group.
	pid, tgid, parentTgid int32
}

// connector is a netlink socket subscribed to process events.
type connector struct {
	fd  int
	buf []byte
}

// openConnector subscribes to process events; it needs CAP_NET_ADMIN and
// CONFIG_PROC_EVENTS.
func openConnector() (*connector, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, unix.NETLINK_CONNECTOR)
	if err != nil {
		return nil, fmt.Errorf("activity: process events socket: %w", err)
	}
	_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, connRcvBuf)
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK, Groups: cnIdxProc}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("activity: process events bind: %w", err)
	}
	le := binary.NativeEndian
	msg := make([]byte, nlmsgHdrBytes+cnMsgBytes+4)
	le.PutUint32(msg[0:], uint32(len(msg)))
	le.PutUint16(msg[4:], unix.NLMSG_DONE)
	le.PutUint32(msg[16:], cnIdxProc)
	le.PutUint32(msg[20:], cnValProc)
	le.PutUint16(msg[32:], 4)
	le.PutUint32(msg[36:], procCnMcastListen)
	if err := unix.Sendto(fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("activity: process events subscribe: %w", err)
	}
	return &connector{fd: fd, buf: make([]byte, 64<<10)}, nil
}

func (c *connector) close() error { return unix.Close(c.fd) }

// drain reads every process event queued now and calls fn for each. It
// reports whether events were lost since the last drain (the socket's
// buffer overflowed).
func (c *connector) drain(fn func(procEvent)) (lost bool) {
	for range maxDrain {
		n, from, err := unix.Recvfrom(c.fd, c.buf, unix.MSG_DONTWAIT)
		switch {
		case errors.Is(err, unix.EINTR):
			continue
		case errors.Is(err, unix.ENOBUFS):
			lost = true
			continue
		case err != nil:
			return lost // EAGAIN: drained
		}
		if sa, ok := from.(*unix.SockaddrNetlink); !ok || sa.Pid != 0 {
			continue // only the kernel speaks here
		}
		parseProcEvents(c.buf[:n], fn)
	}
	return lost
}

// parseProcEvents calls fn for each fork and exit in one datagram from the
// connector; anything else, or anything malformed, is skipped.
func parseProcEvents(b []byte, fn func(procEvent)) {
	le := binary.NativeEndian
	for len(b) >= nlmsgHdrBytes {
		n := int(le.Uint32(b[0:]))
		if n < nlmsgHdrBytes || n > len(b) {
			return
		}
		msg := b[nlmsgHdrBytes:n]
		if next := (n + 3) &^ 3; next < len(b) {
			b = b[next:]
		} else {
			b = nil
		}
		if len(msg) < cnMsgBytes || le.Uint32(msg[0:]) != cnIdxProc || le.Uint32(msg[4:]) != cnValProc {
			continue
		}
		dataLen := int(le.Uint16(msg[16:]))
		data := msg[cnMsgBytes:]
		if dataLen > len(data) {
			continue
		}
		data = data[:dataLen]
		if len(data) < procEventHeader+16 {
			continue
		}
		what := le.Uint32(data[0:])
		ev := data[procEventHeader:]
		i32 := func(off int) int32 { return int32(le.Uint32(ev[off:])) }
		switch what {
		case procEventFork:
			fn(procEvent{fork: true, parentTgid: i32(4), pid: i32(8), tgid: i32(12)})
		case procEventExit:
			fn(procEvent{pid: i32(0), tgid: i32(4)})
		}
	}
}
