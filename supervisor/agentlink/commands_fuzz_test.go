package agentlink

import (
	"context"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// FuzzCommandsOutput feeds a Commands stream's reader what a hostile
// guest may send: a run of messages, each a length byte and that many
// bytes of protobuf. Whatever comes, deliver refuses with DataLoss or
// accepts; no command holds more than its credit, or gets anything after
// its end; and once the stream ends, every command has ended.
func FuzzCommandsOutput(f *testing.F) {
	msg := func(o *agentv1.CommandsOutput) []byte {
		b, _ := proto.Marshal(o)
		return append([]byte{byte(len(b))}, b...)
	}
	f.Add(append(append(msg(event(1, stdoutEvent([]byte("hi")))), msg(event(1, exitEvent(0)))...), msg(event(2, exitEvent(1)))...))
	f.Add(msg(&agentv1.CommandsOutput{Id: 3, Msg: &agentv1.CommandsOutput_End{End: &agentv1.CommandEnd{Code: 5, Message: "nope"}}}))
	f.Add(msg(event(9, exitEvent(0))))
	held := event(2, exitEvent(0))
	held.Held = []*agentv1.ExecResponse{stdoutEvent([]byte("a")), stdoutEvent([]byte("b"))}
	f.Add(msg(held))
	f.Add(msg(&agentv1.CommandsOutput{Id: 1, Msg: &agentv1.CommandsOutput_End{End: &agentv1.CommandEnd{Code: 77}}}))
	f.Fuzz(func(t *testing.T, data []byte) {
		c := &Commands{}
		s := &commandStream{owner: c, cancel: func() {}, running: map[uint64]*Command{},
			wake: make(chan struct{}, 1), stopped: make(chan struct{})}
		c.cur = s
		var cmds []*Command
		for range 3 {
			cmds = append(cmds, s.start(context.Background(), &agentv1.ExecRequest{}))
		}
		for i := 0; len(data) > 0; i++ {
			ended := make([]bool, len(cmds))
			queued := make([]int, len(cmds))
			for j, cmd := range cmds {
				cmd.mu.Lock()
				ended[j], queued[j] = cmd.ended, len(cmd.queue)
				cmd.mu.Unlock()
			}
			n := min(int(data[0]), len(data)-1)
			b := data[1 : 1+n]
			data = data[1+n:]
			var out agentv1.CommandsOutput
			if proto.Unmarshal(b, &out) != nil {
				continue
			}
			if err := s.deliver(&out); err != nil {
				if connect.CodeOf(err) != connect.CodeDataLoss {
					t.Fatalf("refused with %v, want data_loss", err)
				}
				s.end(err)
				break
			}
			for j, cmd := range cmds {
				cmd.mu.Lock()
				if cmd.held > protocol.CommandCredit || cmd.received > cmd.granted {
					t.Fatalf("command %d holds %d units, received %d of %d granted", cmd.id, cmd.held, cmd.received, cmd.granted)
				}
				if ended[j] && len(cmd.queue) > queued[j] {
					t.Fatalf("command %d took an event after its end", cmd.id)
				}
				cmd.mu.Unlock()
			}
			if i%2 == 1 { // the caller takes an event now and then
				cmd := cmds[i%len(cmds)]
				cmd.mu.Lock()
				ready := len(cmd.queue) > 0 || cmd.ended
				cmd.mu.Unlock()
				if ready {
					cmd.Receive()
				}
			}
		}
		if s.err != nil {
			for _, cmd := range cmds {
				cmd.mu.Lock()
				if !cmd.ended {
					t.Fatalf("command %d still running after the stream ended", cmd.id)
				}
				cmd.mu.Unlock()
			}
		}
	})
}
