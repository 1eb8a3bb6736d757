//go:build linux

package server

import (
	"net"
	"testing"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// Serve serves PortService beside the others, on the same connection.
func TestServesPorts(t *testing.T) {
	f := serve(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		if c, err := l.Accept(); err == nil {
			c.Write([]byte("hi"))
			c.Close()
		}
	}()
	c := agentv1connect.NewPortServiceClient(f.hc, protocol.BaseURL, protocol.ClientOptions()...)
	s := c.Connect(callCtx(t))
	defer s.CloseResponse()
	s.Send(&agentv1.PortData{Msg: &agentv1.PortData_Open{Open: &agentv1.PortOpen{Port: uint32(l.Addr().(*net.TCPAddr).Port)}}})
	s.CloseRequest()
	var got string
	for {
		m, err := s.Receive()
		if err != nil {
			break
		}
		switch {
		case m.GetOpened() != nil:
			got += "[opened]"
		case m.GetClose() != nil:
			got += "[close]"
		default:
			got += string(m.GetData())
		}
	}
	if got != "[opened]hi[close]" {
		t.Errorf("got %q", got)
	}
	if f.dials.Load() != 1 {
		t.Errorf("%d connections to the agent, want 1", f.dials.Load())
	}
}
