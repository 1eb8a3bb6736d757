package e2b

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	processpb "github.com/carrel-os/carrel/supervisor/gen/envdpb/process"
)

// A client may lag behind its command's output by subscriberBuffer events
// or subscriberBytes of output before it is cut off: nobody's lag holds
// the command up. A command has at most maxSubscribers clients at once.
const (
	subscriberBuffer = 1024
	subscriberBytes  = 8 << 20
	maxSubscribers   = 16
)

// A follower reads one command's carrel Process stream to the command's
// end, whoever listens, and hands its events to the clients following it
// (Start's caller and each Connect's), as envd does: each from when it
// joined. The stream is the façade's, not a request's: a client that goes
// leaves the command running (e2b's commands are detached), and the
// command's output keeps flowing, so the guest never waits on a client.
type follower struct {
	pid    uint32
	tty    bool
	cancel context.CancelFunc

	mu   sync.Mutex
	subs map[*subscriber]struct{}
	done bool // the command ended, or its stream did
}

type subscriber struct {
	ch     chan *processpb.ProcessEvent
	why    error // set before ch is closed without an end event
	queued int   // output bytes sent on ch and not yet taken; guarded by follower.mu
}

// follow opens a carrel Process call with first (a start or an attach)
// and returns once the command has started, its follower reading on and
// the caller subscribed.
func (s *server) follow(ctx context.Context, first *agentv1.ProcessInput, closeStdin bool, info procInfo) (*follower, *subscriber, error) {
	c := callOf(ctx)
	// The stream outlives the request, with the caller's credential.
	bctx, cancel := context.WithCancel(withCall(context.WithoutCancel(ctx), c))
	stream := s.c.Agent.Process(bctx)
	stream.RequestHeader().Set(protocol.VMHeader, c.vm)
	fail := func(err error) (*follower, *subscriber, error) {
		cancel()
		stream.CloseResponse()
		return nil, nil, mapErr(err)
	}
	// Until the command starts, the request's end ends the call.
	stop := context.AfterFunc(ctx, cancel)
	defer stop()
	if err := stream.Send(first); err != nil && !errors.Is(err, io.EOF) {
		return fail(err)
	}
	if closeStdin {
		_ = stream.Send(&agentv1.ProcessInput{Msg: &agentv1.ProcessInput_CloseStdin{CloseStdin: &agentv1.CloseStdin{}}})
	}
	// The end of what this side sends changes nothing for the command.
	_ = stream.CloseRequest()
	ev, err := stream.Receive()
	if err != nil {
		return fail(err)
	}
	started := ev.GetStarted()
	if started == nil {
		return fail(connect.NewError(connect.CodeInternal, errors.New("process: the command's first event is not its start")))
	}
	if !stop() {
		return fail(ctx.Err()) // the request ended meanwhile
	}
	f := &follower{pid: uint32(started.Pid), tty: info.tty, cancel: cancel, subs: map[*subscriber]struct{}{}}
	sub := f.subscribe()
	info.id, info.follower = started.Id, f
	s.procs.put(c.vm, f.pid, info)
	go func() {
		defer cancel()
		defer stream.CloseResponse()
		err := f.pump(stream)
		s.procs.ended(c.vm, f.pid, f)
		if err != nil {
			s.log.Debug("e2b: a command's stream ended early", "vm", c.vm, "pid", f.pid, "err", err)
		}
	}()
	return f, sub, nil
}

// pump hands each event of the stream to the subscribers, to the end
// event; an error ends the followers' streams without one.
func (f *follower) pump(stream interface {
	Receive() (*agentv1.ExecResponse, error)
}) error {
	for {
		ev, err := stream.Receive()
		if err != nil {
			f.finish(fmt.Errorf("the command's stream ended before the command: %w", err))
			return err
		}
		out := f.event(ev)
		if out == nil {
			continue
		}
		f.broadcast(out)
		if out.GetEnd() != nil {
			f.finish(nil)
			return nil
		}
	}
}

// event is envd's form of one of carrel's events; nil for none.
func (f *follower) event(ev *agentv1.ExecResponse) *processpb.ProcessEvent {
	switch e := ev.Event.(type) {
	case *agentv1.ExecResponse_Stdout:
		data := &processpb.ProcessEvent_DataEvent{Output: &processpb.ProcessEvent_DataEvent_Stdout{Stdout: e.Stdout}}
		if f.tty {
			data.Output = &processpb.ProcessEvent_DataEvent_Pty{Pty: e.Stdout}
		}
		return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Data{Data: data}}
	case *agentv1.ExecResponse_Stderr:
		return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Data{Data: &processpb.ProcessEvent_DataEvent{Output: &processpb.ProcessEvent_DataEvent_Stderr{Stderr: e.Stderr}}}}
	case *agentv1.ExecResponse_Exit:
		return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_End{End: endEvent(e.Exit)}}
	}
	return nil
}

// subscribe adds a client; nil once the command has ended, or when it
// has as many as it may.
func (f *follower) subscribe() *subscriber {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.done || len(f.subs) >= maxSubscribers {
		return nil
	}
	sub := &subscriber{ch: make(chan *processpb.ProcessEvent, subscriberBuffer)}
	f.subs[sub] = struct{}{}
	return sub
}

func (f *follower) unsubscribe(sub *subscriber) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.subs[sub]; ok {
		delete(f.subs, sub)
		close(sub.ch)
	}
}

func (f *follower) broadcast(ev *processpb.ProcessEvent) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := eventBytes(ev)
	for sub := range f.subs {
		if sub.queued+n > subscriberBytes {
			f.cutOff(sub)
			continue
		}
		select {
		case sub.ch <- ev:
			sub.queued += n
		default:
			f.cutOff(sub)
		}
	}
}

// cutOff ends a client that fell too far behind. f.mu must be held.
func (f *follower) cutOff(sub *subscriber) {
	sub.why = connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("process %d: the client fell %d events or %d bytes behind its output", f.pid, subscriberBuffer, subscriberBytes))
	delete(f.subs, sub)
	close(sub.ch)
}

// eventBytes is the output an event carries.
func eventBytes(ev *processpb.ProcessEvent) int {
	d := ev.GetData()
	return len(d.GetStdout()) + len(d.GetStderr()) + len(d.GetPty())
}

// finish ends every subscriber's stream: after the end event, or, with
// why, without one.
func (f *follower) finish(why error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.done = true
	for sub := range f.subs {
		if why != nil {
			sub.why = connect.NewError(connect.CodeUnavailable, why)
		}
		delete(f.subs, sub)
		close(sub.ch)
	}
}

// relay sends a subscriber its start event, then the command's events to
// its end, and a keepalive event every keepalive (0: none) while idle.
// The client's going unsubscribes it; the command runs on.
func (f *follower) relay(ctx context.Context, sub *subscriber, keepalive time.Duration, send func(*processpb.ProcessEvent) error) error {
	defer f.unsubscribe(sub)
	if err := send(&processpb.ProcessEvent{Event: &processpb.ProcessEvent_Start{Start: &processpb.ProcessEvent_StartEvent{Pid: f.pid}}}); err != nil {
		return err
	}
	var tick <-chan time.Time
	if keepalive > 0 {
		t := time.NewTicker(keepalive)
		defer t.Stop()
		tick = t.C
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick:
			if err := send(&processpb.ProcessEvent{Event: &processpb.ProcessEvent_Keepalive{Keepalive: &processpb.ProcessEvent_KeepAlive{}}}); err != nil {
				return err
			}
		case ev, ok := <-sub.ch:
			if !ok {
				f.mu.Lock()
				why := sub.why
				f.mu.Unlock()
				if why == nil {
					why = connect.NewError(connect.CodeUnavailable, fmt.Errorf("process %d: its stream ended", f.pid))
				}
				return why
			}
			f.mu.Lock()
			sub.queued -= eventBytes(ev)
			f.mu.Unlock()
			if err := send(ev); err != nil {
				return err
			}
			if ev.GetEnd() != nil {
				return nil
			}
		}
	}
}
