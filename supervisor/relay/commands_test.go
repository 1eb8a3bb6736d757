package relay

import (
	"context"
	"errors"
	"io"
	"net/http"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/agentlink"
)

// runProcess runs start through the relay's Process route, with the
// client's later messages from msgs (then nothing until the call ends).
func (h *harness) runProcess(ctx context.Context, start *agentv1.ExecRequest, msgs ...*agentv1.ProcessInput) ([]*agentv1.ExecResponse, error) {
	hdr := http.Header{}
	hdr.Set(protocol.VMHeader, testVM)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	recv := func() (*agentv1.ProcessInput, error) {
		if len(msgs) > 0 {
			m := msgs[0]
			msgs = msgs[1:]
			return m, nil
		}
		<-ctx.Done()
		return nil, io.EOF
	}
	var evs []*agentv1.ExecResponse
	err := h.r.process(ctx, hdr, &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Start{Start: start}}, recv,
		func(ev *agentv1.ExecResponse) error { evs = append(evs, ev); return nil })
	return evs, err
}

func (a *fakeAgent) counts() (commands, processes int, signals []int32) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.viaCommands, a.processes, append([]int32(nil), a.signals...)
}

// A command without stdin (Process with no_stdin, and Exec) runs on the
// link's Commands stream; one with stdin open on a Process stream.
func TestNoStdinRunsOnCommands(t *testing.T) {
	h := newHarness(t)
	h.agent.commands = true
	ctx := context.Background()
	if _, err := h.runProcess(ctx, &agentv1.ExecRequest{Argv: []string{"true"}, NoStdin: true}); err != nil {
		t.Fatal(err)
	}
	if err := h.r.Exec(ctx, testVM, &agentv1.ExecRequest{Argv: []string{"true"}}, time.Minute, func(*agentv1.ExecResponse) error { return nil }); err != nil {
		t.Fatal(err)
	}
	if _, err := h.runProcess(ctx, &agentv1.ExecRequest{Argv: []string{"true"}}); err != nil {
		t.Fatal(err)
	}
	if c, p, _ := h.agent.counts(); c != 2 || p != 1 {
		t.Fatalf("%d commands on the Commands stream and %d Process calls, want 2 and 1", c, p)
	}
}

// An agent from before Commands: the first command learns it and runs
// through Exec; the next goes through Process, as before Commands.
func TestNoStdinWithoutCommands(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	for i := range 2 {
		evs, err := h.runProcess(ctx, &agentv1.ExecRequest{Argv: []string{"true"}, NoStdin: true})
		if err != nil || len(evs) == 0 || evs[len(evs)-1].GetExit() == nil {
			t.Fatalf("command %d: %v %v", i, evs, err)
		}
	}
	h.agent.mu.Lock()
	n, p := len(h.agent.starts), h.agent.processes
	h.agent.mu.Unlock()
	if n != 2 || p != 1 {
		t.Fatalf("%d starts, %d through Process; want 2, one through Exec", n, p)
	}
	if st, err := h.vms.link.State(); st == agentlink.Unhealthy {
		t.Errorf("link unhealthy (%v)", err)
	}
}

// Signals reach a command without stdin; stdin is refused with a clear
// error that leaves the link alone.
func TestNoStdinTakesSignalsOnly(t *testing.T) {
	h := newHarness(t)
	h.agent.commands = true
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	evs, err := h.runProcess(ctx, &agentv1.ExecRequest{Argv: []string{"wait"}, NoStdin: true},
		&agentv1.ProcessInput{Msg: &agentv1.ProcessInput_CloseStdin{CloseStdin: &agentv1.CloseStdin{}}},
		&agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Signal{Signal: 2}})
	if err != nil || len(evs) != 2 || evs[1].GetExit().GetCode() != 130 {
		t.Fatalf("signalled: %v %v", evs, err)
	}
	if _, _, sigs := h.agent.counts(); len(sigs) != 1 || sigs[0] != 2 {
		t.Fatalf("the guest got signals %v", sigs)
	}
	for name, msg := range map[string]*agentv1.ProcessInput{
		"stdin":     {Msg: &agentv1.ProcessInput_Stdin{Stdin: []byte("x")}},
		"resize":    {Msg: &agentv1.ProcessInput_Resize{Resize: &agentv1.Resize{Rows: 1, Cols: 1}}},
		"signal 99": {Msg: &agentv1.ProcessInput_Signal{Signal: 99}},
	} {
		_, err := h.runProcess(ctx, &agentv1.ExecRequest{Argv: []string{"wait"}, NoStdin: true}, msg)
		if connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("%s: got %v, want invalid_argument", name, err)
		}
		var ce *connect.Error
		if errors.As(err, &ce) && ce.Message() == "" {
			t.Errorf("%s: no message", name)
		}
	}
	if st, err := h.vms.link.State(); st == agentlink.Unhealthy {
		t.Errorf("link unhealthy (%v): the client's mistake is not the guest's", err)
	}
}

// After an older agent makes carreld fall back to Exec, signals still
// reach the command, through the agent's Signal call: one sent once it
// has started, and one sent before.
func TestNoStdinSignalAfterFallBack(t *testing.T) {
	for _, early := range []bool{false, true} {
		t.Run(map[bool]string{false: "started", true: "early"}[early], func(t *testing.T) { signalAfterFallBack(t, early) })
	}
}

func signalAfterFallBack(t *testing.T, early bool) {
	h := newHarness(t)
	if early {
		h.agent.gate = make(chan struct{})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sig := make(chan *agentv1.ProcessInput)
	hdr := http.Header{}
	hdr.Set(protocol.VMHeader, testVM)
	started := make(chan struct{})
	var once sync.Once
	recv := func() (*agentv1.ProcessInput, error) {
		select {
		case m := <-sig:
			return m, nil
		case <-ctx.Done():
			return nil, io.EOF
		}
	}
	errc := make(chan error, 1)
	var evs []*agentv1.ExecResponse
	go func() {
		errc <- h.r.process(ctx, hdr, &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Start{Start: &agentv1.ExecRequest{Argv: []string{"wait"}, NoStdin: true}}}, recv,
			func(ev *agentv1.ExecResponse) error {
				evs = append(evs, ev)
				once.Do(func() { close(started) })
				return nil
			})
	}()
	if early {
		sig <- &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Signal{Signal: 15}}
		time.Sleep(50 * time.Millisecond) // on the Commands stream or after the fall back: either must keep it
		close(h.agent.gate)
	} else {
		<-started
		sig <- &agentv1.ProcessInput{Msg: &agentv1.ProcessInput_Signal{Signal: 15}}
	}
	if err := <-errc; err != nil || len(evs) != 2 || evs[1].GetExit().GetCode() != 130 {
		t.Fatalf("%v %v", evs, err)
	}
	if _, _, sigs := h.agent.counts(); len(sigs) != 1 || sigs[0] != 15 {
		t.Fatalf("the guest got signals %v", sigs)
	}
}
