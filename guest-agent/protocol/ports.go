package protocol

import (
	"fmt"
	"net"
	"strconv"
	"sync"
)

// PortAddress returns the address, in the guest, that a port-forward to
// host and port dials: host is empty (meaning 127.0.0.1), 127.0.0.1 or
// ::1, and port is from 1 to 65535. Anything else is an error. carreld
// checks it before it relays a connection; the agent checks it again.
func PortAddress(host string, port uint32) (string, error) {
	if port == 0 || port > 65535 {
		return "", fmt.Errorf("port %d out of range 1-65535", port)
	}
	switch host {
	case "":
		host = "127.0.0.1"
	case "127.0.0.1", "::1":
	default:
		return "", fmt.Errorf("host %q refused: only 127.0.0.1 and ::1 can be reached", CleanText(host, 64))
	}
	return net.JoinHostPort(host, strconv.Itoa(int(port))), nil
}

// FirstError keeps the first error that several goroutines pumping one
// connection report. The zero value is ready to use.
type FirstError struct {
	mu  sync.Mutex
	err error
}

// Set records err unless an error was recorded already.
func (f *FirstError) Set(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err == nil {
		f.err = err
	}
}

// Get returns the first error recorded, or nil.
func (f *FirstError) Get() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.err
}
