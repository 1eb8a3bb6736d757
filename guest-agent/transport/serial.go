//go:build linux

package transport

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

const (
	virtioPortsDir = "/sys/class/virtio-ports"
	devDir         = "/dev"
	hostPollEvery  = 10 * time.Millisecond
)

// FindSerialPort returns the device node of the virtio-serial port named
// name, or an error wrapping ErrNotFound.
func FindSerialPort(name string) (string, error) {
	return findPort(virtioPortsDir, devDir, name)
}

// findPort scans sysDir/vport*/name. The name arrives from the host after
// the port itself, and devtmpfs adds the node after sysfs, so a port that is
// still appearing is reported as not found.
func findPort(sysDir, devDir, name string) (string, error) {
	entries, err := os.ReadDir(sysDir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return "", fmt.Errorf("virtio-serial port %q: %w", name, err)
	}
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(sysDir, e.Name(), "name"))
		if err != nil || strings.TrimSpace(string(b)) != name {
			continue
		}
		dev := filepath.Join(devDir, e.Name())
		if _, err := os.Stat(dev); err != nil {
			continue
		}
		return dev, nil
	}
	return "", fmt.Errorf("virtio-serial port %q: %w", name, ErrNotFound)
}

// ListenSerial returns a listener for the virtio-serial port named name.
//
// A port is one byte stream, so there is at most one live connection:
// Accept opens the device, waits until the host side is connected, and
// returns it; the next Accept blocks until that connection is closed (the
// HTTP/2 server closes it when a read hits EOF, which is what the port
// reports once the host disconnects), then opens the port again. Closing
// the listener makes a blocked Accept return net.ErrClosed; it does not
// close the live connection.
func ListenSerial(name string) (net.Listener, error) {
	return listenSerial(name, serialConfig{
		sysDir:   virtioPortsDir,
		devDir:   devDir,
		open:     openPort,
		waitHost: waitHost,
	})
}

// serialConfig holds what tests replace: where ports are found, how the
// device is opened, and how Accept waits for the host.
type serialConfig struct {
	sysDir, devDir string
	open           func(path string) (fd int, err error)
	waitHost       func(fd int, stop <-chan struct{}) error
	// slotWait, if set, is called as Accept begins to wait for the slot.
	slotWait func()
}

type serialListener struct {
	name, path string
	cfg        serialConfig
	slot       chan struct{} // holds a token while a connection is live
	closed     chan struct{}
	closeOnce  sync.Once
}

var _ net.Listener = (*serialListener)(nil)

func listenSerial(name string, cfg serialConfig) (*serialListener, error) {
	path, err := findPort(cfg.sysDir, cfg.devDir, name)
	if err != nil {
		return nil, err
	}
	return &serialListener{
		name:   name,
		path:   path,
		cfg:    cfg,
		slot:   make(chan struct{}, 1),
		closed: make(chan struct{}),
	}, nil
}

// Accept waits for the previous connection to close and for the host to
// connect, then returns the port as a connection.
func (l *serialListener) Accept() (net.Conn, error) {
	select {
	case <-l.closed:
		return nil, net.ErrClosed
	default:
	}
	if l.cfg.slotWait != nil {
		l.cfg.slotWait()
	}
	select {
	case <-l.closed:
		return nil, net.ErrClosed
	case l.slot <- struct{}{}:
	}
	c, err := l.connect()
	if err != nil {
		<-l.slot
		return nil, &net.OpError{Op: "accept", Net: serialNetwork, Addr: l.Addr(), Err: err}
	}
	return c, nil
}

func (l *serialListener) connect() (net.Conn, error) {
	fd, err := l.cfg.open(l.path)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", l.path, err)
	}
	if err := l.cfg.waitHost(fd, l.closed); err != nil {
		unix.Close(fd)
		return nil, err
	}
	// os.NewFile registers the non-blocking fd with the runtime poller, so
	// reads park instead of blocking a thread and deadlines work.
	f := os.NewFile(uintptr(fd), l.path)
	return &serialConn{f: f, w: newPortWriter(f), addr: serialAddr(l.name), release: func() { <-l.slot }}, nil
}

// Close makes Accept return net.ErrClosed. It does not close a live
// connection.
func (l *serialListener) Close() error {
	l.closeOnce.Do(func() { close(l.closed) })
	return nil
}

// Addr returns the port's name.
func (l *serialListener) Addr() net.Addr { return serialAddr(l.name) }

func openPort(path string) (int, error) {
	return unix.Open(path, unix.O_RDWR|unix.O_NONBLOCK|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
}

// waitHost returns once the host side of the port is connected. A virtio
// console port reports POLLHUP for as long as no host is connected (and
// reads return EOF), and poll does not block on it, so this polls on a
// short timer.
func waitHost(fd int, stop <-chan struct{}) error {
	tick := time.NewTicker(hostPollEvery)
	defer tick.Stop()
	for {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		_, err := unix.Poll(fds, 0)
		switch {
		case err == nil && fds[0].Revents&unix.POLLHUP == 0:
			return nil
		case err != nil && !errors.Is(err, unix.EINTR):
			return fmt.Errorf("poll: %w", err)
		}
		select {
		case <-stop:
			return net.ErrClosed
		case <-tick.C:
		}
	}
}

const serialNetwork = "virtio-serial"

// serialAddr is the address of both ends of a port: its name.
type serialAddr string

func (a serialAddr) Network() string { return serialNetwork }
func (a serialAddr) String() string  { return string(a) }

// closeLinger is how long Close waits for queued writes to reach the
// host.
const closeLinger = 500 * time.Millisecond

// serialConn is an open port. Close releases the listener's slot.
type serialConn struct {
	f        *os.File
	w        *portWriter // all writes go through it
	addr     serialAddr
	release  func()
	once     sync.Once
	closeErr error
}

var _ net.Conn = (*serialConn)(nil)

func (c *serialConn) Read(b []byte) (int, error)  { return c.f.Read(b) }
func (c *serialConn) Write(b []byte) (int, error) { return c.w.Write(b) }

// Close closes the port and lets the listener accept again. Only the first
// call does anything.
func (c *serialConn) Close() error {
	c.once.Do(func() {
		c.w.close(closeLinger)
		c.closeErr = c.f.Close()
		c.release()
	})
	return c.closeErr
}

func (c *serialConn) LocalAddr() net.Addr  { return c.addr }
func (c *serialConn) RemoteAddr() net.Addr { return c.addr }
func (c *serialConn) SetDeadline(t time.Time) error {
	return errors.Join(c.f.SetReadDeadline(t), c.w.SetWriteDeadline(t))
}
func (c *serialConn) SetReadDeadline(t time.Time) error  { return c.f.SetReadDeadline(t) }
func (c *serialConn) SetWriteDeadline(t time.Time) error { return c.w.SetWriteDeadline(t) }
