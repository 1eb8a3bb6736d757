//go:build linux

package transport

import (
	"fmt"
	"log/slog"
	"net"
	"os"

	"github.com/mdlayher/vsock"
)

// vmaddrCIDAny is what the kernel reports as the local CID when vsock is
// loaded but the VM has no vsock device.
const vmaddrCIDAny = 0xFFFFFFFF

// ListenVsock listens on the vsock port and accepts only connections from
// the host (CID 2); others are closed and logged. log may be nil.
func ListenVsock(port uint32, log *slog.Logger) (net.Listener, error) {
	l, err := vsock.Listen(port, nil)
	if err != nil {
		return nil, fmt.Errorf("listen vsock port %d: %w", port, err)
	}
	return newCIDListener(l, vsock.Host, log), nil
}

// CheckVsock returns nil if this VM has a vsock device: /dev/vsock exists
// and the kernel reports a guest CID.
func CheckVsock() error {
	if _, err := os.Stat("/dev/vsock"); err != nil {
		return fmt.Errorf("vsock: %w", err)
	}
	cid, err := vsock.ContextID()
	if err != nil {
		return fmt.Errorf("vsock: local cid: %w", err)
	}
	if cid == vmaddrCIDAny || cid <= vsock.Host {
		return fmt.Errorf("vsock: no guest cid (got %#x): %w", cid, ErrNotFound)
	}
	return nil
}

// cidListener accepts only connections whose remote vsock CID is allowed.
type cidListener struct {
	net.Listener
	allow uint32
	log   *slog.Logger
}

var _ net.Listener = (*cidListener)(nil)

func newCIDListener(l net.Listener, allow uint32, log *slog.Logger) *cidListener {
	if log == nil {
		log = slog.Default()
	}
	return &cidListener{Listener: l, allow: allow, log: log}
}

// Accept returns the next connection from the allowed CID.
func (l *cidListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		addr, ok := c.RemoteAddr().(*vsock.Addr)
		if ok && addr.ContextID == l.allow {
			return c, nil
		}
		l.log.Warn("rejected vsock connection", "remote", c.RemoteAddr(), "want_cid", l.allow)
		c.Close()
	}
}
