package relay

import (
	"context"
	"errors"
	"fmt"
	"io"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// MaxPortChunk caps one data message from the guest (the agent sends at
// most 32 KiB). A client's larger messages are split to this
// size on their way in.
const MaxPortChunk = 64 << 10

// portRelay serves carrel.agent.v1.PortService on carreld's socket for the
// VM named in the Carrel-Vm header: each call is one TCP connection to a
// port on the guest's loopback. The host checks the request before the
// guest sees it, and the shape of everything the guest sends back.
type portRelay struct{ *Relay }

var _ agentv1connect.PortServiceHandler = portRelay{}

// Connect relays one connection. It ends when the guest ends the call
// (after both directions are closed, or with the connection's error), when
// the client goes away, or when either side breaks the protocol.
func (r portRelay) Connect(ctx context.Context, in *connect.BidiStream[agentv1.PortData, agentv1.PortData]) (err error) {
	link, err := r.link(in.RequestHeader())
	if err != nil {
		return err
	}
	first, err := in.Receive()
	if errors.Is(err, io.EOF) {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("port connect: no open message"))
	}
	if err != nil {
		return err
	}
	open := first.GetOpen()
	if open == nil {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("port connect: the first message must be open"))
	}
	if _, err := protocol.PortAddress(open.GetHost(), open.GetPort()); err != nil {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("port connect: %w", err))
	}
	if err := r.allowForward(ctx, in.RequestHeader().Get(protocol.VMHeader), open.Host, open.Port); err != nil {
		return err
	}
	var chk portCheck
	act, err := r.call(ctx, in.RequestHeader().Get(protocol.VMHeader)).BeginForward(ctx, open.Host, open.Port)
	if err != nil {
		return err
	}
	defer func() { act.EndForward(ctx, chk.fromGuest, err) }()
	c, done := link.Ports()

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	g := c.Connect(ctx)
	defer g.CloseResponse()
	// Cancelling alone does not wake a Receive while the request body is
	// open (net/http's HTTP/2 client watches the context only once the
	// body is done); closing the response resets the stream.
	stop := context.AfterFunc(ctx, func() { g.CloseResponse() })
	defer stop()
	// A failed send shows up as the guest's reply (or its absence) below.
	_ = g.Send(&agentv1.PortData{Msg: &agentv1.PortData_Open{Open: &agentv1.PortOpen{Host: open.Host, Port: open.Port}}})
	reply, err := g.Receive()
	if errors.Is(err, io.EOF) {
		return errGuest("ended the call before the connection opened")
	}
	if err != nil {
		return relayErr(ctx, done, err)
	}
	if reply.GetOpened() == nil {
		return errGuest("the first reply must be opened, not %T", reply.Msg)
	}
	// Fresh messages, here and below: nothing the guest adds (unknown
	// fields) reaches the client.
	if err := in.Send(&agentv1.PortData{Msg: &agentv1.PortData_Opened{Opened: &agentv1.PortOpened{}}}); err != nil {
		return err
	}

	var clientErr protocol.FirstError
	go func() {
		if err := relayToGuest(in, g); err != nil {
			clientErr.Set(err)
			cancel()
		}
	}()

	for {
		msg, err := g.Receive()
		if err != nil {
			if e := clientErr.Get(); e != nil {
				return e
			}
			if errors.Is(err, io.EOF) {
				return chk.end()
			}
			return relayErr(ctx, done, err)
		}
		out, err := chk.check(msg)
		if err != nil {
			return err
		}
		if err := in.Send(out); err != nil {
			return err
		}
	}
}

// guestSender is the guest end of a Connect call, as relayToGuest uses it.
type guestSender interface {
	Send(*agentv1.PortData) error
	CloseRequest() error
}

// relayToGuest passes the client's bytes and its close on to the guest. The
// end of the client's stream counts as its close. It returns an error only
// for a client that breaks the protocol; a stream that breaks ends the call
// from the other side.
func relayToGuest(in *connect.BidiStream[agentv1.PortData, agentv1.PortData], g guestSender) error {
	closeMsg := &agentv1.PortData{Msg: &agentv1.PortData_Close{Close: &agentv1.PortClose{}}}
	for {
		msg, err := in.Receive()
		if errors.Is(err, io.EOF) {
			g.Send(closeMsg)
			g.CloseRequest()
			return nil
		}
		if err != nil {
			return err
		}
		switch m := msg.Msg.(type) {
		case *agentv1.PortData_Data:
			for b := m.Data; len(b) > 0; {
				n := min(len(b), MaxPortChunk)
				if g.Send(&agentv1.PortData{Msg: &agentv1.PortData_Data{Data: b[:n]}}) != nil {
					return nil
				}
				b = b[n:]
			}
		case *agentv1.PortData_Close:
			g.Send(closeMsg)
			g.CloseRequest()
			return nil
		case *agentv1.PortData_Open:
			return connect.NewError(connect.CodeInvalidArgument, errors.New("port connect: a second open"))
		default:
			return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("port connect: unexpected message %T from the client", msg.Msg))
		}
	}
}

// portCheck enforces the shape of the guest's side of a connection after
// opened: data chunks of at most MaxPortChunk, then one close, then nothing.
type portCheck struct {
	closed    bool
	fromGuest int64 // data bytes relayed from the guest
}

// check returns the message to pass on, rebuilt from what was checked.
func (c *portCheck) check(msg *agentv1.PortData) (*agentv1.PortData, error) {
	switch m := msg.Msg.(type) {
	case *agentv1.PortData_Data:
		if c.closed {
			return nil, errGuest("data after close")
		}
		if len(m.Data) > MaxPortChunk {
			return nil, errGuest("a %d-byte chunk, over the %d-byte cap", len(m.Data), MaxPortChunk)
		}
		c.fromGuest += int64(len(m.Data))
		return &agentv1.PortData{Msg: &agentv1.PortData_Data{Data: m.Data}}, nil
	case *agentv1.PortData_Close:
		if c.closed {
			return nil, errGuest("a second close")
		}
		c.closed = true
		return &agentv1.PortData{Msg: &agentv1.PortData_Close{Close: &agentv1.PortClose{}}}, nil
	}
	return nil, errGuest("unexpected message %T", msg.Msg)
}

// end turns a stream's clean end into the call's result: the guest may end
// the call only after its close.
func (c *portCheck) end() error {
	if !c.closed {
		return errGuest("ended the connection without a close")
	}
	return nil
}
