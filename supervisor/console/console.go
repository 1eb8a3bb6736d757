// Package console records a VM's serial console. The guest controls what
// it prints, so the record is bounded: the log file rotates once at
// MaxFileBytes (keeping one old file), and memory holds only the tail.
package console

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
)

// Limits on what one VM's console may cost the host.
const (
	MaxFileBytes = 1 << 20
	tailBytes    = 16 << 10
)

// Recorder copies a console stream to a log file and keeps its tail.
type Recorder struct {
	path string

	mu   sync.Mutex
	tail []byte
	f    *os.File
	size int64
	done chan struct{}
	err  error
}

// Record connects with dial and records until the stream ends or ctx is
// cancelled. It appends to the log at path.
func Record(ctx context.Context, dial func(context.Context) (net.Conn, error), path string) (*Recorder, error) {
	c, err := dial(ctx)
	if err != nil {
		return nil, fmt.Errorf("connect console: %w", err)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("open console log: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		c.Close()
		f.Close()
		return nil, fmt.Errorf("stat console log: %w", err)
	}
	r := &Recorder{path: path, f: f, size: st.Size(), done: make(chan struct{})}
	go func() {
		<-ctx.Done()
		c.Close()
	}()
	go r.copy(c)
	return r, nil
}

func (r *Recorder) copy(c net.Conn) {
	defer close(r.done)
	defer c.Close()
	buf := make([]byte, 4096)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			r.write(buf[:n])
		}
		if err != nil {
			r.mu.Lock()
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				r.err = err
			}
			r.f.Close()
			r.mu.Unlock()
			return
		}
	}
}

func (r *Recorder) write(p []byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.tail = append(r.tail, p...)
	if len(r.tail) > tailBytes {
		r.tail = append(r.tail[:0], r.tail[len(r.tail)-tailBytes:]...)
	}
	if r.size+int64(len(p)) > MaxFileBytes {
		r.rotate()
	}
	n, _ := r.f.Write(p)
	r.size += int64(n)
}

// rotate keeps one previous file; a failure just keeps writing in place.
func (r *Recorder) rotate() {
	if err := os.Rename(r.path, r.path+".1"); err != nil {
		return
	}
	f, err := os.OpenFile(r.path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return
	}
	r.f.Close()
	r.f, r.size = f, 0
}

// Tail returns up to n of the last lines printed on the console, with
// non-printable bytes replaced.
func (r *Recorder) Tail(n int) string {
	r.mu.Lock()
	s := string(r.tail)
	r.mu.Unlock()
	return lastLines(s, n)
}

// maxLine bounds a line LastLineWith returns: the guest prints it.
const maxLine = 512

// LastLineWith returns the last line of the console's tail that contains
// marker, with non-printable bytes replaced and cut at maxLine bytes; ""
// if there is none.
func (r *Recorder) LastLineWith(marker string) string {
	r.mu.Lock()
	s := string(r.tail)
	r.mu.Unlock()
	lines := strings.Split(lastLines(s, tailBytes), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if l := strings.TrimSpace(lines[i]); strings.Contains(l, marker) {
			if len(l) > maxLine {
				l = strings.ToValidUTF8(l[:maxLine], "") + "..."
			}
			return l
		}
	}
	return ""
}

// Done is closed when the console stream has ended.
func (r *Recorder) Done() <-chan struct{} { return r.done }

func lastLines(s string, n int) string {
	s = strings.ToValidUTF8(s, "?")
	s = strings.Map(func(r rune) rune {
		if r == '\n' || r == '\t' || (r >= ' ' && r != 0x7f) {
			return r
		}
		return -1
	}, s)
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
