package agent

import (
	"io"
	"log/slog"
	"sync"
)

// NewLogger returns the agent's log: slog's text records on w, each line
// prefixed "carrel-agent: ", as the console and carreld show them.
func NewLogger(w io.Writer) *slog.Logger {
	return slog.New(slog.NewTextHandler(&prefixWriter{w: w, prefix: []byte("carrel-agent: ")}, nil))
}

// prefixWriter prefixes each write (one slog record) with prefix.
type prefixWriter struct {
	mu     sync.Mutex
	w      io.Writer
	prefix []byte
	buf    []byte
}

func (p *prefixWriter) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.buf = append(append(p.buf[:0], p.prefix...), b...)
	if _, err := p.w.Write(p.buf); err != nil {
		return 0, err
	}
	return len(b), nil
}
