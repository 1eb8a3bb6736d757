//go:build carrel_misbehave

// The test build of the agent misbehaves on purpose, to show that the host
// survives a hostile guest. It is built only with -tags carrel_misbehave
// (tests/hostile_test.go does) and never ships.
//
// Writing a mode and a newline to /tmp/misbehave inside the guest (with
// carrel exec) makes the agent, a second after it notices (it looks every 100 ms), do
// that to its current connection to the host, once:
//
//	garbage    write random bytes into the HTTP/2 stream
//	oversized  announce a 16 MiB HTTP/2 frame
//	slowloris  start a frame, then trickle it a byte at a time
//	silent     stop reading and writing for 30 s, as a wedged guest would,
//	           then drop the connection
//
// The next connection from the host is served normally again.
package main

import (
	"crypto/rand"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"time"
)

const misbehaveFile = "/tmp/misbehave"

func init() {
	wrapListener = func(l net.Listener, log *slog.Logger) net.Listener {
		ml := &misbehavingListener{Listener: l, log: log}
		go ml.watch()
		return ml
	}
}

type misbehavingListener struct {
	net.Listener
	log *slog.Logger

	mu  sync.Mutex
	cur *misbehavingConn
}

func (l *misbehavingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	mc := &misbehavingConn{Conn: c, stop: make(chan struct{}), resume: make(chan struct{})}
	l.mu.Lock()
	l.cur = mc
	l.mu.Unlock()
	return mc, nil
}

func (l *misbehavingListener) watch() {
	for range time.Tick(100 * time.Millisecond) {
		b, err := os.ReadFile(misbehaveFile)
		if err != nil || !strings.HasSuffix(string(b), "\n") {
			// Not there, or caught between the shell's open and its write
			// (which once lost the mode, and the test waited in vain).
			continue
		}
		os.Remove(misbehaveFile)
		mode := strings.TrimSpace(string(b))
		l.mu.Lock()
		c := l.cur
		l.mu.Unlock()
		if c == nil {
			continue
		}
		l.log.Warn("misbehaving on purpose", "mode", mode)
		// After a second: the command that wrote the file has had its
		// exit status sent by then, so the misbehaviour hits the link and
		// not the reply of the call that asked for it.
		time.AfterFunc(time.Second, func() { c.misbehave(mode) })
	}
}

type misbehavingConn struct {
	net.Conn
	wmu    sync.Mutex // raw writes interleave with the server's
	stop   chan struct{}
	resume chan struct{}
	stopMu sync.Once
}

// silenced blocks while the connection is silent, and reports whether it
// was, after which the connection is gone.
func (c *misbehavingConn) silenced() bool {
	select {
	case <-c.stop:
		<-c.resume
		return true
	default:
		return false
	}
}

func (c *misbehavingConn) Write(p []byte) (int, error) {
	if c.silenced() {
		return 0, net.ErrClosed
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return c.Conn.Write(p)
}

func (c *misbehavingConn) Read(p []byte) (int, error) {
	if c.silenced() {
		return 0, net.ErrClosed
	}
	return c.Conn.Read(p)
}

func (c *misbehavingConn) raw(p []byte) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.Conn.Write(p)
}

func (c *misbehavingConn) misbehave(mode string) {
	switch mode {
	case "garbage":
		b := make([]byte, 64<<10)
		rand.Read(b)
		// Random bytes start with a frame header the host could skip (an
		// unknown type with a small length) once in a few hundred runs,
		// and the link then desyncs until keepalive notices. Start with
		// one HTTP/2 forbids outright, a SETTINGS frame on stream 1, so
		// the test sees the garbage rejected every time.
		copy(b, []byte{0x00, 0x00, 0x06, 0x04, 0x00, 0x00, 0x00, 0x00, 0x01})
		c.raw(b)
	case "oversized":
		// DATA frame header: length 0xffffff, type 0, flags 0, stream 1.
		c.raw([]byte{0xff, 0xff, 0xff, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01})
	case "slowloris":
		c.wmu.Lock() // hold the stream: nothing else gets through
		defer c.wmu.Unlock()
		c.Conn.Write([]byte{0x00, 0x40, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01})
		for i := 0; i < 120; i++ {
			if _, err := c.Conn.Write([]byte{0}); err != nil {
				return
			}
			time.Sleep(500 * time.Millisecond)
		}
	case "silent":
		c.stopMu.Do(func() {
			close(c.stop)
			time.AfterFunc(30*time.Second, func() {
				c.Conn.Close()
				close(c.resume)
			})
		})
	}
}
