package client

import (
	"context"
	"errors"
	"io"
	"sync"

	"google.golang.org/protobuf/proto"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// ListProcesses lists the processes running in vm.
func (c *Client) ListProcesses(ctx context.Context, vm string) ([]*agentv1.ProcessInfo, error) {
	resp, err := c.Agent.ListProcesses(ctx, ForVM(vm, &agentv1.ListProcessesRequest{}))
	if err != nil {
		return nil, err
	}
	return resp.Msg.Processes, nil
}

// Signal sends sig (0 means SIGTERM) to the process pid in vm.
func (c *Client) Signal(ctx context.Context, vm string, pid int32, sig int32) error {
	_, err := c.Agent.Signal(ctx, ForVM(vm, &agentv1.SignalRequest{Target: &agentv1.SignalRequest_Pid{Pid: pid}, Signal: sig}))
	return err
}

// Session is one interactive command in a VM: a new one (Start) or a
// detached one to attach to (Attach).
type Session struct {
	VM     string
	Start  *agentv1.ExecRequest
	Attach string

	// Stdin, if not nil, is copied to the command; its EOF closes the
	// command's stdin.
	Stdin  io.Reader
	Stdout io.Writer
	Stderr io.Writer
	// Resize, if not nil, carries terminal size changes.
	Resize <-chan *agentv1.Resize
	// Signals, if not nil, carries signals for the command.
	Signals <-chan int32
	// Started, if not nil, is called with the command's id and pid.
	Started func(id string, pid int32)
	// DetachAfterStart ends the call as soon as the command has started;
	// with Start.Detach set, the command keeps running, and the guest
	// leaves it unattached before it answers (detach_at_start), so that
	// an attach made once Run has returned finds it free.
	DetachAfterStart bool
}

// ErrDetached is returned by Run when the session ended with the command
// still running (DetachAfterStart).
var ErrDetached = errors.New("detached")

// Run runs the session until the command exits (returning its status),
// ctx ends, or it detaches.
func (c *Client) Run(ctx context.Context, s Session) (*agentv1.ExitStatus, error) {
	ctx, cancel := context.WithCancel(ctx)
	stream := c.Agent.Process(ctx)
	defer func() {
		// Ending the call is what detaches (or, without detach, kills the
		// command): cancel, and close both directions so the stream is
		// reset even while its request body is open.
		cancel()
		stream.CloseRequest()
		stream.CloseResponse()
	}()
	stream.RequestHeader().Set(protocol.VMHeader, s.VM)
	// A cancelled ctx must end a Receive that waits on a quiet command.
	stopClose := context.AfterFunc(ctx, func() { stream.CloseResponse() })
	defer stopClose()
	start := s.Start
	if s.DetachAfterStart && start.GetDetach() && !start.GetDetachAtStart() {
		start = proto.CloneOf(start)
		start.DetachAtStart = true
	}
	first := &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Start{Start: start}}
	if s.Start == nil {
		first = &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Attach{Attach: &agentv1.AttachRequest{Id: s.Attach}}}
	}
	if err := stream.Send(first); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	go pumpInput(ctx, stream, s)
	for {
		ev, err := stream.Receive()
		if err != nil {
			if errors.Is(err, io.EOF) {
				err = errors.New("the stream ended without an exit status")
			}
			return nil, err
		}
		switch e := ev.Event.(type) {
		case *agentv1.ExecResponse_Started:
			if s.Started != nil {
				s.Started(e.Started.Id, e.Started.Pid)
			}
			if s.DetachAfterStart {
				return nil, ErrDetached
			}
		case *agentv1.ExecResponse_Stdout:
			if s.Stdout != nil {
				if _, err := s.Stdout.Write(e.Stdout); err != nil {
					return nil, err
				}
			}
		case *agentv1.ExecResponse_Stderr:
			if s.Stderr != nil {
				if _, err := s.Stderr.Write(e.Stderr); err != nil {
					return nil, err
				}
			}
		case *agentv1.ExecResponse_Exit:
			return e.Exit, nil
		}
	}
}

type sender interface {
	Send(*agentv1.ProcessInput) error
}

// pumpInput sends stdin, resizes and signals until ctx ends.
func pumpInput(ctx context.Context, stream sender, s Session) {
	var mu sync.Mutex // one Send at a time
	send := func(m *agentv1.ProcessInput) bool {
		mu.Lock()
		defer mu.Unlock()
		return stream.Send(m) == nil
	}
	if s.Stdin != nil {
		go func() {
			buf := make([]byte, 32<<10)
			for {
				n, err := s.Stdin.Read(buf)
				if n > 0 && !send(&agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Stdin{Stdin: append([]byte(nil), buf[:n]...)}}) {
					return
				}
				if err != nil {
					send(&agentv1.ProcessInput{Msg: &agentv1.ProcessInput_CloseStdin{CloseStdin: &agentv1.CloseStdin{}}})
					return
				}
			}
		}()
	}
	for {
		select {
		case <-ctx.Done():
			return
		case r, ok := <-s.Resize:
			if ok && !send(&agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Resize{Resize: r}}) {
				return
			}
		case sig, ok := <-s.Signals:
			if ok && !send(&agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Signal{Signal: sig}}) {
				return
			}
		}
	}
}
