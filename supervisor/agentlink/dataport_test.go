package agentlink

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/guest-agent/transport"
)

// socketPair returns the host's end of a socket pair as a connection and
// the guest's as a file, both closed when t ends.
func socketPair(t *testing.T) (net.Conn, *os.File) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_NONBLOCK|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	hf := os.NewFile(uintptr(fds[0]), "host")
	hc, err := net.FileConn(hf)
	hf.Close()
	if err != nil {
		t.Fatal(err)
	}
	gf := os.NewFile(uintptr(fds[1]), "guest")
	t.Cleanup(func() { hc.Close(); gf.Close() })
	return hc, gf
}

// dataPair returns a link whose data port is one end of a socket pair,
// and the guest's DataPort on the other.
func dataPair(t *testing.T) (*Link, *transport.DataPort) {
	t.Helper()
	hc, gf := socketPair(t)
	guest := transport.NewDataPort(gf)
	l := New(func(context.Context) (net.Conn, error) { return nil, net.ErrClosed }, nil)
	l.UseDataPort(func(context.Context) (net.Conn, error) { return hc, nil })
	l.markReady(&agentv1.HealthResponse{DataPort: true})
	return l, guest
}

func TestDataPortBothWays(t *testing.T) {
	l, guest := dataPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, size := range []int{0, 1, 4095, 1 << 20, 1<<20 + 1, 5<<20 + 77} {
		data := make([]byte, size)
		rand.Read(data)

		out := l.SendData(ctx)
		if out == nil {
			t.Fatal("no data port to send on")
		}
		var got bytes.Buffer
		recvd := make(chan error, 1)
		go func() {
			_, err := guest.Receive(ctx, out.ID, &got)
			recvd <- err
		}()
		for b := data; len(b) > 0; {
			n := min(len(b), 700_000)
			if err := out.Write(b[:n]); err != nil {
				t.Fatal(err)
			}
			b = b[n:]
		}
		if err := out.End(); err != nil {
			t.Fatal(err)
		}
		if err := <-recvd; err != nil {
			t.Fatalf("%d bytes to the guest: %v", size, err)
		}
		out.Abort() // the guest has it all: the port goes back
		if !bytes.Equal(got.Bytes(), data) {
			t.Fatalf("%d bytes to the guest: got %d different bytes", size, got.Len())
		}

		in := l.ReceiveData(ctx)
		if in == nil {
			t.Fatal("no data port to receive on")
		}
		sent := make(chan error, 1)
		go func() {
			_, err := guest.Send(ctx, in.ID, bytes.NewReader(data))
			sent <- err
		}()
		var back []byte
		for {
			b, err := in.Next(ctx)
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatalf("%d bytes from the guest: %v", size, err)
			}
			back = append(back, b...)
		}
		in.Close()
		if err := <-sent; err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(back, data) {
			t.Fatalf("%d bytes from the guest: got %d different bytes", size, len(back))
		}
	}
}

// rawPair is dataPair with the guest's end as a bare connection, to send
// what a hostile guest would.
func rawPair(t *testing.T) (*Link, net.Conn) {
	t.Helper()
	host, guest := net.Pipe()
	t.Cleanup(func() { host.Close(); guest.Close() })
	dials := 0
	l := New(func(context.Context) (net.Conn, error) { return nil, net.ErrClosed }, nil)
	l.UseDataPort(func(context.Context) (net.Conn, error) {
		dials++
		if dials > 1 {
			return nil, net.ErrClosed
		}
		return host, nil
	})
	l.markReady(&agentv1.HealthResponse{DataPort: true})
	// Not the first connection of a carreld that found the agent
	// running: what the guest sends is held to the frames from its first
	// byte.
	l.data.resyncIn = false
	return l, guest
}

func TestDataPortHostileGuest(t *testing.T) {
	for name, send := range map[string]func(id uint64) []byte{
		"bad magic": func(id uint64) []byte { return []byte("not a frame at all, not at all") },
		"skipped frame": func(id uint64) []byte {
			return protocol.AppendFrame(nil, protocol.Frame{ID: id, Seq: 1})
		},
		"oversized frame": func(id uint64) []byte {
			b := protocol.AppendFrame(nil, protocol.Frame{ID: id})
			binary.LittleEndian.PutUint32(b[20:], protocol.MaxDataFrameBytes+1)
			return b
		},
		"another transfer mid-way": func(id uint64) []byte {
			b := protocol.AppendFrame(nil, protocol.Frame{ID: id, Length: 1})
			b = append(b, 'x')
			return protocol.AppendFrame(b, protocol.Frame{ID: id + 1})
		},
	} {
		t.Run(name, func(t *testing.T) {
			l, guest := rawPair(t)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			in := l.ReceiveData(ctx)
			if in == nil {
				t.Fatal("no data port")
			}
			go guest.Write(send(in.ID))
			var err error
			for err == nil {
				_, err = in.Next(ctx)
			}
			in.Close()
			if !errors.Is(err, ErrDataProtocol) {
				t.Fatalf("got %v, want the guest's breach", err)
			}
			if l.ReceiveData(ctx) != nil || l.SendData(ctx) != nil {
				t.Fatal("the data port is still used after the guest broke its protocol")
			}
		})
	}
}

// A guest's abort ends the transfer with ErrTransferAborted and leaves the
// port in use; frames left over from a transfer given up before are passed
// over.
func TestDataPortAbortAndStale(t *testing.T) {
	l, guest := rawPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	in := l.ReceiveData(ctx)
	stale := protocol.AppendFrame(nil, protocol.Frame{ID: in.ID ^ 1, Seq: 3, Length: 2})
	stale = append(stale, "zz"...)
	go guest.Write(append(stale, protocol.AppendFrame(nil, protocol.Frame{Flags: protocol.FrameAbort, ID: in.ID})...))
	if _, err := in.Next(ctx); !errors.Is(err, protocol.ErrTransferAborted) {
		t.Fatalf("got %v, want the abort", err)
	}
	in.Close()
	if in := l.ReceiveData(ctx); in == nil {
		t.Fatal("an abort turned the data port off")
	} else {
		in.Close()
	}
}

// The guest's Receive drops the transfer when the host aborts it, and a
// failed write to its file does not leave the host blocked.
func TestGuestReceiveAbortAndFailedWrite(t *testing.T) {
	l, guest := dataPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out := l.SendData(ctx)
	got := make(chan error, 1)
	go func() {
		_, err := guest.Receive(ctx, out.ID, io.Discard)
		got <- err
	}()
	out.Write(make([]byte, 3<<20))
	out.Abort()
	if err := <-got; !errors.Is(err, protocol.ErrTransferAborted) {
		t.Fatalf("got %v, want the abort", err)
	}

	out = l.SendData(ctx)
	go func() {
		_, err := guest.Receive(ctx, out.ID, failingWriter{})
		got <- err
	}()
	if err := out.Write(make([]byte, 5<<20)); err != nil {
		t.Fatal(err)
	}
	if err := out.End(); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err == nil || !strings.Contains(err.Error(), "disk full") {
		t.Fatalf("got %v, want the write's error", err)
	}
	out.Abort()
}

// A transfer whose frames all fit in the send buffer has sent its last
// one before the guest's receiver has started. It keeps the port until it
// is given back: a second transfer's receiver starting first would pass
// its frames over as stale.
func TestDataPortHeldUntilGivenBack(t *testing.T) {
	l, guest := dataPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	first := []byte("the first transfer")
	out := l.SendData(ctx)
	if err := errors.Join(out.Write(first), out.End()); err != nil {
		t.Fatal(err)
	}
	if l.SendData(ctx) != nil {
		t.Fatal("a second transfer got the port while the first, ended, was not given back")
	}
	var got bytes.Buffer
	if _, err := guest.Receive(ctx, out.ID, &got); err != nil || got.String() != string(first) {
		t.Fatalf("first transfer: %q, %v", got.String(), err)
	}
	out.Abort() // after End: gives the port back, and sends nothing
	out = l.SendData(ctx)
	if out == nil {
		t.Fatal("the port was not given back")
	}
	received := make(chan error, 1)
	got.Reset()
	go func() {
		_, err := guest.Receive(ctx, out.ID, &got)
		received <- err
	}()
	if err := errors.Join(out.Write([]byte("second")), out.End(), <-received); err != nil || got.String() != "second" {
		t.Fatalf("second transfer: %q, %v", got.String(), err)
	}
	out.Abort()
}

type failingWriter struct{}

func (failingWriter) Write([]byte) (int, error) { return 0, errors.New("disk full") }

// A carreld that finds the agent running (it restarted mid-transfer) may
// meet what is left of the last one's frames either way: its first
// transfers pass over them.
func TestDataPortResyncAfterRestart(t *testing.T) {
	hc, gf := socketPair(t)
	// What the last carreld and the guest were in the middle of: the
	// guest had read a frame's header and part of its payload; the last
	// carreld had read the header and part of the payload of the guest's.
	cut := protocol.AppendFrame(nil, protocol.Frame{ID: 5, Length: 1000})
	hc.Write(append(cut, make([]byte, 300)...))
	gf.Write(bytes.Repeat([]byte("tail of a payload "), 20))

	guest := transport.NewDataPort(gf)
	l := New(func(context.Context) (net.Conn, error) { return nil, net.ErrClosed }, nil)
	l.UseDataPort(func(context.Context) (net.Conn, error) { return hc, nil })
	l.markReady(&agentv1.HealthResponse{DataPort: true})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	data := []byte("after the restart")
	out := l.SendData(ctx)
	var got bytes.Buffer
	recvd := make(chan error, 1)
	go func() {
		_, err := guest.Receive(ctx, out.ID, &got)
		recvd <- err
	}()
	if err := out.Write(data); err != nil {
		t.Fatal(err)
	}
	if err := out.End(); err != nil {
		t.Fatal(err)
	}
	if err := <-recvd; err != nil || got.String() != string(data) {
		t.Fatalf("to the guest: %q, %v", got.String(), err)
	}

	in := l.ReceiveData(ctx)
	go guest.Send(ctx, in.ID, bytes.NewReader(data))
	b, err := in.Next(ctx)
	if err != nil || string(b) != string(data) {
		t.Fatalf("from the guest: %q, %v", b, err)
	}
	if _, err := in.Next(ctx); err != io.EOF {
		t.Fatalf("after the last frame: %v", err)
	}
	in.Close()
}

// carreld's end of the data port asks for SendBufferBytes of send buffer,
// which Linux caps at net.core.wmem_max and then doubles.
func TestDataPortSendBuffer(t *testing.T) {
	hc, gf := socketPair(t)
	sndbuf := func() int {
		raw, err := hc.(syscall.Conn).SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var n int
		var serr error
		if err := raw.Control(func(fd uintptr) { n, serr = syscall.GetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_SNDBUF) }); err != nil {
			t.Fatal(err)
		}
		if serr != nil {
			t.Fatal(serr)
		}
		return n
	}
	before := sndbuf()
	maxb, err := os.ReadFile("/proc/sys/net/core/wmem_max")
	if err != nil {
		t.Skipf("no net.core.wmem_max to check against: %v", err)
	}
	wmemMax, err := strconv.Atoi(strings.TrimSpace(string(maxb)))
	if err != nil {
		t.Fatal(err)
	}
	l := New(func(context.Context) (net.Conn, error) { return nil, net.ErrClosed }, nil)
	defer l.Close()
	l.UseDataPort(func(context.Context) (net.Conn, error) { return hc, nil })
	l.markReady(&agentv1.HealthResponse{DataPort: true})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out := l.SendData(ctx)
	if out == nil {
		t.Fatal("no data port to send on")
	}
	received := make(chan error, 1)
	go func() {
		_, err := transport.NewDataPort(gf).Receive(ctx, out.ID, io.Discard)
		received <- err
	}()
	if err := errors.Join(out.Write([]byte("x")), out.End(), <-received); err != nil {
		t.Fatal(err)
	}
	out.Abort()
	got, want := sndbuf(), 2*min(SendBufferBytes, wmemMax)
	if got != want {
		t.Fatalf("send buffer %d bytes (%d before the port was used), want %d (net.core.wmem_max %d)", got, before, want, wmemMax)
	}
	if out.stall != sendStall(got) {
		t.Fatalf("frame write limit %v, want %v for a %d-byte buffer", out.stall, sendStall(got), got)
	}
}

// A frame write may wait for three quarters of the send buffer to drain,
// and its own frame: its limit allows the guest 256 KiB/s for that.
func TestSendStall(t *testing.T) {
	for _, c := range []struct {
		sndbuf int
		want   time.Duration
	}{
		{212992, dataStallLimit},                // Debian's default: 1.2 MiB at 256 KiB/s is under 10 s
		{2 * 212992, dataStallLimit},            // the request, capped at Debian's wmem_max
		{2 * SendBufferBytes, 28 * time.Second}, // wmem_max raised: 6 MiB and a frame
	} {
		if got := sendStall(c.sndbuf); got != c.want {
			t.Errorf("sendStall(%d) = %v, want %v", c.sndbuf, got, c.want)
		}
	}
}
