package mcpserver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// maxForwards caps the forwards of the whole process, every session's.
const maxForwards = 64

// openForwards counts them.
var openForwards atomic.Int32

// forwards are the port forwards a server holds: a listener on the host's
// loopback whose connections each become a connection to a port in the
// VM (carreld's PortService, decided by the VM's policy like a carrel
// port-forward). They end when stopped, when their session ends, or
// with the process that serves them (carrel mcp).
type forwards struct {
	mu   sync.Mutex
	next int
	m    map[int]*forward
}

type forward struct {
	ln     net.Listener
	vm     string
	port   uint16
	cancel context.CancelFunc
}

// ForwardIn is port_forward's input.
type ForwardIn struct {
	VMArg
	Action    string `json:"action" jsonschema:"start, stop or list"`
	GuestPort uint16 `json:"guest_port,omitempty" jsonschema:"start: the port in the VM"`
	LocalPort uint16 `json:"local_port,omitempty" jsonschema:"start: the port on the host's loopback; any free one when 0"`
	ID        int    `json:"id,omitempty" jsonschema:"stop: the forward to stop"`
}

// Forward describes one forward.
type Forward struct {
	ID        int    `json:"id"`
	VM        string `json:"vm"`
	GuestPort uint16 `json:"guest_port"`
	Local     string `json:"local" jsonschema:"the address on the host to connect to"`
}

// ForwardOut is port_forward's output.
type ForwardOut struct {
	Forwards []Forward `json:"forwards" jsonschema:"start: the new forward; list: all of them; stop: none"`
}

func (t *tools) portForward(ctx context.Context, _ *mcp.CallToolRequest, in ForwardIn) (*mcp.CallToolResult, ForwardOut, error) {
	f := &t.fwd
	switch in.Action {
	case "list":
		f.mu.Lock()
		defer f.mu.Unlock()
		out := ForwardOut{Forwards: []Forward{}}
		for id, fw := range f.m {
			out.Forwards = append(out.Forwards, Forward{ID: id, VM: fw.vm, GuestPort: fw.port, Local: fw.ln.Addr().String()})
		}
		return nil, out, nil
	case "stop":
		f.mu.Lock()
		fw, ok := f.m[in.ID]
		delete(f.m, in.ID)
		f.mu.Unlock()
		if !ok {
			return nil, ForwardOut{}, fmt.Errorf("no forward %d", in.ID)
		}
		fw.stop()
		return nil, ForwardOut{Forwards: []Forward{}}, nil
	case "start":
	default:
		return nil, ForwardOut{}, fmt.Errorf("action %q: want start, stop or list", in.Action)
	}
	vm, err := t.target(in.VMArg)
	if err != nil {
		return nil, ForwardOut{}, err
	}
	if in.GuestPort == 0 {
		return nil, ForwardOut{}, errors.New("start: give guest_port")
	}
	// One connection first: the policy decides it now, not at the first
	// connection an agent makes.
	dctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	probe, err := t.c.DialPort(dctx, vm, in.GuestPort)
	cancel()
	if err != nil {
		return nil, ForwardOut{}, explain(err)
	}
	probe.Close()
	ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(int(in.LocalPort))))
	if err != nil {
		return nil, ForwardOut{}, err
	}
	if openForwards.Add(1) > maxForwards {
		openForwards.Add(-1)
		ln.Close()
		return nil, ForwardOut{}, fmt.Errorf("%d forwards already: stop one first", maxForwards)
	}
	f.mu.Lock()
	if f.m == nil {
		f.m = map[int]*forward{}
	}
	f.next++
	id := f.next
	fctx, fcancel := context.WithCancel(context.WithoutCancel(ctx))
	fw := &forward{ln: ln, vm: vm, port: in.GuestPort, cancel: fcancel}
	f.m[id] = fw
	f.mu.Unlock()
	go t.serveForward(fctx, fw)
	return nil, ForwardOut{Forwards: []Forward{{ID: id, VM: vm, GuestPort: in.GuestPort, Local: ln.Addr().String()}}}, nil
}

// serveForward carries each connection to fw's listener to the VM's port
// until the listener closes.
func (t *tools) serveForward(ctx context.Context, fw *forward) {
	for {
		c, err := fw.ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			dctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			g, err := t.c.DialPort(dctx, fw.vm, fw.port)
			cancel()
			if err != nil {
				return
			}
			defer g.Close()
			stop := context.AfterFunc(ctx, func() { c.Close(); g.Close() })
			defer stop()
			done := make(chan struct{}, 2)
			go func() { io.Copy(g, c); closeWrite(g); done <- struct{}{} }()
			go func() { io.Copy(c, g); closeWrite(c); done <- struct{}{} }()
			<-done
			<-done
		}()
	}
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
}

// stop ends fw: its listener and the connections it carries.
func (fw *forward) stop() {
	fw.cancel()
	fw.ln.Close()
	openForwards.Add(-1)
}

// stopAll ends every forward of f.
func (f *forwards) stopAll() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for id, fw := range f.m {
		fw.stop()
		delete(f.m, id)
	}
}
