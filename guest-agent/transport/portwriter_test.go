package transport

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"testing"
	"time"
)

// gatedWriter records each write, and holds the first until released.
type gatedWriter struct {
	mu      sync.Mutex
	writes  [][]byte
	started chan struct{} // closed once the first write is under way
	gate    chan struct{}
	fail    error
}

func newGated(fail error) *gatedWriter {
	return &gatedWriter{started: make(chan struct{}), gate: make(chan struct{}), fail: fail}
}

func (g *gatedWriter) Write(b []byte) (int, error) {
	g.mu.Lock()
	first := len(g.writes) == 0
	g.writes = append(g.writes, bytes.Clone(b))
	fail := g.fail
	g.mu.Unlock()
	if first {
		close(g.started)
		<-g.gate
	}
	if fail != nil {
		return 0, fail
	}
	return len(b), nil
}

func (g *gatedWriter) SetWriteDeadline(time.Time) error { return nil }

func (g *gatedWriter) all() (n int, data []byte) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.writes), bytes.Join(g.writes, nil)
}

func TestPortWriterMergesWhileAWriteIsUnderWay(t *testing.T) {
	g := newGated(nil)
	w := newPortWriter(g)
	var want []byte
	for i, s := range []string{"headers", "message", "exit", "trailers"} {
		if n, err := w.Write([]byte(s)); n != len(s) || err != nil {
			t.Fatalf("write %q: %d, %v", s, n, err)
		}
		want = append(want, s...)
		if i == 0 {
			<-g.started
		}
	}
	close(g.gate)
	w.close(5 * time.Second) // waits for the queue
	n, got := g.all()
	if !bytes.Equal(got, want) || n != 2 {
		t.Fatalf("port got %q in %d writes, want %q in 2 (the first, then the rest merged)", got, n, want)
	}
	if _, err := w.Write([]byte("late")); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("write after close: %v", err)
	}
}

func TestPortWriterKeepsOrderAcrossLargeWrites(t *testing.T) {
	r, f, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	w := newPortWriter(f)
	var want bytes.Buffer
	done := make(chan []byte)
	go func() {
		b, _ := io.ReadAll(r)
		done <- b
	}()
	for i := range 200 {
		size := 100 + i*7
		if i%10 == 0 {
			size = maxQueuedWrite + 1 + i*1000 // written from the caller's buffer
		}
		b := bytes.Repeat([]byte{byte(i)}, size)
		want.Write(b)
		if _, err := w.Write(b); err != nil {
			t.Fatal(err)
		}
	}
	w.close(5 * time.Second)
	f.Close()
	if got := <-done; !bytes.Equal(got, want.Bytes()) {
		t.Fatalf("read %d bytes, not the %d written in order", len(got), want.Len())
	}
}

func TestPortWriterWaitsUnderTheDeadlineWhenFull(t *testing.T) {
	g := newGated(nil)
	w := newPortWriter(g)
	chunk := make([]byte, maxQueuedWrite)
	if _, err := w.Write(chunk); err != nil {
		t.Fatal(err)
	}
	<-g.started // now being written, held
	for range maxQueued / maxQueuedWrite {
		if _, err := w.Write(chunk); err != nil {
			t.Fatal(err)
		}
	}
	w.SetWriteDeadline(time.Now().Add(50 * time.Millisecond))
	if _, err := w.Write(chunk); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("write to a full queue: %v, want a deadline error", err)
	}
	w.SetWriteDeadline(time.Time{})
	close(g.gate)
	if _, err := w.Write(chunk); err != nil {
		t.Fatalf("write once the port takes data again: %v", err)
	}
}

func TestPortWriterFailsAfterAFailedWrite(t *testing.T) {
	broken := errors.New("port gone")
	g := newGated(broken)
	w := newPortWriter(g)
	w.Write([]byte("a"))
	close(g.gate)
	deadline := time.Now().Add(5 * time.Second)
	for {
		_, err := w.Write([]byte("b"))
		if errors.Is(err, broken) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("writes still succeed after the port failed: %v", err)
		}
		time.Sleep(time.Millisecond)
	}
}
