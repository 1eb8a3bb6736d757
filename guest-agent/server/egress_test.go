//go:build linux

package server

import (
	"testing"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/egress"
	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
)

// TestEgressServed: Serve serves Config.Egress beside the other services,
// and leaves EgressService unimplemented without it.
func TestEgressServed(t *testing.T) {
	connectTo := func(f *fixture) error {
		c := agentv1connect.NewEgressServiceClient(f.hc, protocol.BaseURL, protocol.ClientOptions()...)
		bs := c.Connect(callCtx(t))
		defer bs.CloseResponse()
		bs.Send(&agentv1.EgressData{Msg: &agentv1.EgressData_Verdict{Verdict: &agentv1.EgressVerdict{Id: 7}}})
		bs.CloseRequest()
		_, err := bs.Receive()
		return err
	}
	if err := connectTo(serve(t)); connect.CodeOf(err) != connect.CodeUnimplemented {
		t.Errorf("EgressService without Config.Egress: %v, want unimplemented", err)
	}
	f := serve(t, func(c *Config) { c.Egress = egress.New(egress.Options{}) })
	// The service answers: no request 7 is waiting.
	if err := connectTo(f); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("EgressService with Config.Egress: %v, want not_found", err)
	}
	if _, err := f.client.Health(callCtx(t), connect.NewRequest(&agentv1.HealthRequest{})); err != nil {
		t.Errorf("Health beside EgressService: %v", err)
	}
}
