//go:build linux

// Package requests carries what programs in the guest ask their host for,
// a checkpoint of their own computer say. A program writes one JSON line
// to the agent's unix socket (carrel-agent request does); the agent hands
// the request to carreld on the GuestRequests stream carreld holds open;
// carreld decides it by the VM's carrel.guest policy, records it, acts,
// and answers with AnswerGuestRequest; the answer goes back to the program
// as one JSON line. The guest's word is not trusted: carreld checks and
// bounds everything again, and the socket is open to every user of the
// guest because the host's policy, not the guest, decides.
package requests

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

// SocketPath is where the agent takes requests in the guest (not under
// /run/carrel, which only root may enter), and
// AgentPath where every program finds carrel-agent to make them with
// (ExposeSelf): on PATH, and under /usr, which the guest's sandbox lets
// commands run programs from.
const (
	SocketPath = "/run/carrel-agent/request.sock"
	AgentPath  = "/usr/local/bin/carrel-agent"
)

// Kinds of request the agent passes on.
const KindCheckpoint = "checkpoint"

// Bounds.
const (
	// AnswerTimeout is how long a request waits for carreld's answer.
	AnswerTimeout = 2 * time.Minute
	maxLine       = 4 << 10
	maxWaiting    = 16
	readTimeout   = 5 * time.Second
)

// Request is what a program writes, as one JSON line.
type Request struct {
	Kind string `json:"kind"`
	Name string `json:"name"`
	Note string `json:"note,omitempty"`
}

// Answer is what it reads back, as one JSON line.
type Answer struct {
	Allowed bool   `json:"allowed"`
	Done    bool   `json:"done"`
	Reason  string `json:"reason,omitempty"`
	Error   string `json:"error,omitempty"`
}

// Broker holds requests until carreld takes and answers them.
type Broker struct {
	Log *slog.Logger

	mu      sync.Mutex
	next    uint64
	pending map[uint64]chan *agentv1.GuestAnswer
	queue   chan *agentv1.GuestRequest
	serving context.CancelCauseFunc // ends the current GuestRequests call
}

// New returns a broker.
func New(log *slog.Logger) *Broker {
	if log == nil {
		log = slog.Default()
	}
	return &Broker{Log: log, pending: map[uint64]chan *agentv1.GuestAnswer{}, queue: make(chan *agentv1.GuestRequest, maxWaiting)}
}

// Ask passes req to carreld and waits for its answer, or ctx's end.
func (b *Broker) Ask(ctx context.Context, req *agentv1.GuestRequest) (*agentv1.GuestAnswer, error) {
	ch := make(chan *agentv1.GuestAnswer, 1)
	b.mu.Lock()
	b.next++
	req.Id = b.next
	b.pending[req.Id] = ch
	b.mu.Unlock()
	defer func() {
		b.mu.Lock()
		delete(b.pending, req.Id)
		b.mu.Unlock()
	}()
	select {
	case b.queue <- req:
	default:
		return nil, fmt.Errorf("%d requests are already waiting for the host", maxWaiting)
	}
	select {
	case a := <-ch:
		return a, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("no answer from the host: %w", ctx.Err())
	}
}

// Serve sends requests with send until ctx ends or sending fails. A new
// call ends the one before with CodeAborted, as carreld holds one.
func (b *Broker) Serve(ctx context.Context, send func(*agentv1.GuestRequest) error) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	b.mu.Lock()
	if b.serving != nil {
		b.serving(errReplaced)
	}
	b.serving = cancel
	b.mu.Unlock()
	for {
		select {
		case <-ctx.Done():
			if errors.Is(context.Cause(ctx), errReplaced) {
				return connect.NewError(connect.CodeAborted, errReplaced)
			}
			return nil
		case req := <-b.queue:
			if err := send(req); err != nil {
				// Put back for the next call; its asker is still waiting.
				select {
				case b.queue <- req:
				default:
				}
				return err
			}
		}
	}
}

var errReplaced = errors.New("a newer GuestRequests call took over")

// Answer delivers carreld's answer to the request's asker.
func (b *Broker) Answer(a *agentv1.GuestAnswer) error {
	b.mu.Lock()
	ch, ok := b.pending[a.GetId()]
	delete(b.pending, a.GetId())
	b.mu.Unlock()
	if !ok {
		return connect.NewError(connect.CodeNotFound, fmt.Errorf("no request %d is waiting", a.GetId()))
	}
	ch <- a
	return nil
}

// Listen takes requests on a unix socket at path until ctx ends.
func (b *Broker) Listen(ctx context.Context, path string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	_ = os.Remove(path)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return err
	}
	// Every user may ask; the host's policy decides.
	if err := os.Chmod(path, 0o666); err != nil {
		l.Close()
		return err
	}
	go func() {
		<-ctx.Done()
		l.Close()
	}()
	for {
		c, err := l.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		go b.handle(ctx, c)
	}
}

// handle takes one request from c and writes its answer.
func (b *Broker) handle(ctx context.Context, c *net.UnixConn) {
	defer c.Close()
	reply := func(a Answer) {
		_ = c.SetWriteDeadline(time.Now().Add(readTimeout))
		line, _ := json.Marshal(a)
		_, _ = c.Write(append(line, '\n'))
	}
	req := &agentv1.GuestRequest{}
	if raw, err := c.SyscallConn(); err == nil {
		_ = raw.Control(func(fd uintptr) {
			if cred, err := syscall.GetsockoptUcred(int(fd), syscall.SOL_SOCKET, syscall.SO_PEERCRED); err == nil {
				req.Uid, req.Pid = cred.Uid, cred.Pid
			}
		})
	}
	_ = c.SetReadDeadline(time.Now().Add(readTimeout))
	sc := bufio.NewScanner(c)
	sc.Buffer(make([]byte, 0, 512), maxLine)
	if !sc.Scan() {
		reply(Answer{Error: "no request: write one JSON line of at most 4 KiB"})
		return
	}
	var r Request
	if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
		reply(Answer{Error: "bad request: " + err.Error()})
		return
	}
	if r.Kind != KindCheckpoint {
		reply(Answer{Error: fmt.Sprintf("unknown request %q: the agent passes on %q", r.Kind, KindCheckpoint)})
		return
	}
	req.Kind, req.Name, req.Note = r.Kind, r.Name, r.Note
	actx, cancel := context.WithTimeout(ctx, AnswerTimeout)
	defer cancel()
	a, err := b.Ask(actx, req)
	if err != nil {
		reply(Answer{Error: err.Error()})
		return
	}
	b.Log.Info("guest request answered", "kind", r.Kind, "name", r.Name, "uid", req.Uid, "allowed", a.GetAllowed(), "done", a.GetDone())
	reply(Answer{Allowed: a.GetAllowed(), Done: a.GetDone(), Reason: a.GetReason()})
}

// Send asks through the socket at path and returns the answer: what
// carrel-agent request runs.
func Send(ctx context.Context, path string, r Request) (Answer, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return Answer{}, fmt.Errorf("the agent's request socket: %w", err)
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(dl)
	}
	line, err := json.Marshal(r)
	if err != nil {
		return Answer{}, err
	}
	if _, err := c.Write(append(line, '\n')); err != nil {
		return Answer{}, err
	}
	sc := bufio.NewScanner(c)
	sc.Buffer(make([]byte, 0, 512), maxLine)
	if !sc.Scan() {
		if err := sc.Err(); err != nil {
			return Answer{}, err
		}
		return Answer{}, errors.New("the agent closed the request without an answer")
	}
	var a Answer
	if err := json.Unmarshal(sc.Bytes(), &a); err != nil {
		return Answer{}, fmt.Errorf("the agent's answer: %w", err)
	}
	return a, nil
}

// ExposeSelf makes the running agent's executable runnable at path, for
// programs in the guest to run carrel-agent request with. An agent run
// from a file of the image (a service of the image's init) gets a symbolic
// link to that file. As PID 1 of carrel's images the agent ran from the
// initramfs, which is gone once the real root is up (its file lives on only
// as /proc/self/exe): it gets a copy, left as it is when it already holds
// the same bytes.
func ExposeSelf(path string) error {
	self, err := os.Open("/proc/self/exe")
	if err != nil {
		return err
	}
	defer self.Close()
	if exe, ok := ownFile(self); ok {
		if exe == path {
			return nil
		}
		if cur, err := os.Readlink(path); err == nil && cur == exe {
			return nil
		}
		tmp := path + ".new"
		_ = os.Remove(tmp)
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			return err
		}
		if err := os.Symlink(exe, tmp); err != nil {
			return err
		}
		return os.Rename(tmp, path)
	}
	if same, err := sameBytes(self, path); err == nil && same {
		return nil
	}
	if _, err := self.Seek(0, io.SeekStart); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".carrel-agent-")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := io.Copy(tmp, self); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(0o755); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// ownFile returns the path of the file the agent runs from, when it is
// still there (os.Executable names a file that is self).
func ownFile(self *os.File) (string, bool) {
	exe, err := os.Executable()
	if err != nil {
		return "", false
	}
	a, err := os.Stat(exe)
	if err != nil {
		return "", false
	}
	b, err := self.Stat()
	if err != nil {
		return "", false
	}
	return exe, os.SameFile(a, b)
}

// sameBytes reports whether the file at path holds what f holds.
func sameBytes(f *os.File, path string) (bool, error) {
	g, err := os.Open(path)
	if err != nil {
		return false, err
	}
	defer g.Close()
	a, err := f.Stat()
	if err != nil {
		return false, err
	}
	b, err := g.Stat()
	if err != nil || a.Size() != b.Size() {
		return false, err
	}
	ba, bb := make([]byte, 64<<10), make([]byte, 64<<10)
	for {
		n, errA := io.ReadFull(f, ba)
		m, errB := io.ReadFull(g, bb)
		if n != m || !bytes.Equal(ba[:n], bb[:m]) {
			return false, nil
		}
		if errA != nil || errB != nil {
			return errA == errB, nil // both ended, at the same place
		}
	}
}
