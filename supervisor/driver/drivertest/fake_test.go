package drivertest

import (
	"context"
	"errors"
	"io"
	"testing"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/driver"
)

// agentOf starts a fake VM and returns a client for its agent.
func agentOf(t *testing.T, d *Driver) agentv1connect.AgentServiceClient {
	t.Helper()
	inst, err := d.Start(context.Background(), driver.Spec{Name: "t", Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.VM(inst.PID).Exit)
	dial, _ := d.AgentDialer(inst)
	hc, tr := protocol.NewHTTPClient(dial)
	t.Cleanup(tr.CloseIdleConnections)
	return agentv1connect.NewAgentServiceClient(hc, protocol.BaseURL, protocol.ClientOptions()...)
}

// process sends first, then in; it returns the events up to the exit
// status or the stream's end, and the stream's error.
func process(t *testing.T, c agentv1connect.AgentServiceClient, first *agentv1.ProcessInput, in ...*agentv1.ProcessInput) ([]*agentv1.ExecResponse, error) {
	t.Helper()
	s := c.Process(context.Background())
	defer s.CloseResponse()
	for _, m := range append([]*agentv1.ProcessInput{first}, in...) {
		if err := s.Send(m); err != nil && !errors.Is(err, io.EOF) {
			t.Fatal(err)
		}
	}
	var evs []*agentv1.ExecResponse
	for {
		ev, err := s.Receive()
		if err != nil {
			return evs, ignoreEOF(err)
		}
		evs = append(evs, ev)
		if ev.GetExit() != nil {
			return evs, nil
		}
	}
}

func ignoreEOF(err error) error {
	if errors.Is(err, io.EOF) {
		return nil
	}
	return err
}

var start = &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Start{Start: &agentv1.ExecRequest{Argv: []string{"cat"}}}}

func stdin(s string) *agentv1.ProcessInput {
	return &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Stdin{Stdin: []byte(s)}}
}

func TestProcessActsLikeCat(t *testing.T) {
	c := agentOf(t, New())
	closeStdin := &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_CloseStdin{CloseStdin: &agentv1.CloseStdin{}}}
	evs, err := process(t, c, start, stdin("one "), stdin("two"), closeStdin)
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 4 || evs[0].GetStarted().GetPid() != 101 || evs[0].GetStarted().GetId() != "fake-1" ||
		string(evs[1].GetStdout()) != "one " || string(evs[2].GetStdout()) != "two" ||
		evs[3].GetExit() == nil || evs[3].GetExit().Code != 0 {
		t.Errorf("events %v", evs)
	}

	resize := &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Resize{Resize: &agentv1.Resize{Rows: 1, Cols: 1}}}
	sigint := &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Signal{Signal: 2}}
	evs, err = process(t, c, start, resize, sigint)
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 2 || evs[0].GetStarted().GetId() != "fake-2" || evs[1].GetExit().GetCode() != 130 || evs[1].GetExit().GetSignal() != "SIGINT" {
		t.Errorf("events after a signal: %v", evs)
	}

	attach := &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Attach{Attach: &agentv1.AttachRequest{Id: "fake-1"}}}
	if _, err := process(t, c, attach); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("attach: %v", err)
	}
	if _, err := process(t, c, stdin("x")); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("stdin first: %v", err)
	}
	if _, err := process(t, c, start, &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Signal{Signal: 65}}); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("signal 65: %v", err)
	}
}

func TestProcessIsScripted(t *testing.T) {
	d := New()
	d.SetNext(Behavior{Process: func(_ context.Context, s *connect.BidiStream[agentv1.ProcessInput, agentv1.ExecResponse]) error {
		return s.Send(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stderr{Stderr: make([]byte, protocol.MaxMessageBytes)}})
	}})
	_, err := process(t, agentOf(t, d), start)
	// The script's send is not capped: the reader's cap is what it meets.
	if connect.CodeOf(err) != connect.CodeResourceExhausted || connect.IsWireError(err) {
		t.Errorf("an oversized event: %v", err)
	}
}
