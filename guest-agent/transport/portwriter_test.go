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

// countingWriter counts the deadlines set on it.
type countingWriter struct {
	mu        sync.Mutex
	deadlines int
	n         int
}

func (c *countingWriter) Write(b []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n += len(b)
	return len(b), nil
}

func (c *countingWriter) SetWriteDeadline(time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.deadlines++
	return nil
}

// The HTTP/2 server sets and clears a write deadline around each flush;
// none of that may reach the port, whose deadline moves only as often as
// the stall limit needs.
func TestPortWriterKeepsTheCallersDeadlineOffThePort(t *testing.T) {
	c := &countingWriter{}
	w := newPortWriter(c)
	for range 200 {
		w.SetWriteDeadline(time.Now().Add(10 * time.Second))
		if _, err := w.Write([]byte("frame")); err != nil {
			t.Fatal(err)
		}
		w.SetWriteDeadline(time.Time{})
		if _, err := w.Write(make([]byte, maxQueuedWrite+1)); err != nil { // straight to the port
			t.Fatal(err)
		}
	}
	w.close(time.Second)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n != 200*(5+maxQueuedWrite+1) {
		t.Fatalf("the port got %d bytes, want %d", c.n, 200*(5+maxQueuedWrite+1))
	}
	if c.deadlines > 2 {
		t.Fatalf("the port's deadline was set %d times for 400 writes in well under the stall limit; want at most 2", c.deadlines)
	}
}

// A write the port takes nothing of fails after the stall limit, and so
// does every later one: the host has stopped reading.
// stalling returns a port writer on a pipe whose stall limit is 100 ms,
// and the pipe's read end.
func stalling(t *testing.T) (*os.File, *portWriter) {
	r, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close(); pw.Close() })
	w := newPortWriter(pw)
	w.stallLimit = 100 * time.Millisecond
	return r, w
}

func TestPortWriterFailsAStalledWrite(t *testing.T) {
	_, w := stalling(t)
	start := time.Now()
	_, err := w.Write(make([]byte, 1<<20)) // more than the pipe holds; nobody reads
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a write nobody reads: %v, want a deadline error", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("the stalled write failed after %v, want about twice the stall limit", took)
	}
	if _, err := w.Write([]byte("x")); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a write after the port failed: %v, want the same error", err)
	}
}

// A write that the port takes slowly, but steadily, is not a stall, however
// long it takes in all.
func TestPortWriterLetsASlowWriteFinish(t *testing.T) {
	r, w := stalling(t)
	const size = 1 << 20
	got := make(chan int, 1)
	go func() {
		buf := make([]byte, 64<<10)
		n := 0
		for n < size {
			time.Sleep(20 * time.Millisecond) // 64 KiB per 20 ms: about 330 ms in all
			m, err := r.Read(buf)
			n += m
			if err != nil {
				break
			}
		}
		got <- n
	}()
	if n, err := w.Write(make([]byte, size)); err != nil || n != size {
		t.Fatalf("a slow but steady write: %d, %v; want %d bytes and no error", n, err, size)
	}
	if n := <-got; n != size {
		t.Fatalf("the reader got %d bytes, want %d", n, size)
	}
}
