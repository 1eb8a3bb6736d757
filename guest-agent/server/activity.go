//go:build linux

package server

import (
	"context"
	"errors"

	"connectrpc.com/connect"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

// Activity streams the workspace activity of the agent's commands from
// Config.Activity; CodeUnimplemented when the agent has none.
func (s *service) Activity(ctx context.Context, _ *connect.Request[agentv1.ActivityRequest], stream *connect.ServerStream[agentv1.ActivityResponse]) error {
	if s.cfg.Activity == nil {
		return connect.NewError(connect.CodeUnimplemented, errors.New("activity: this agent does not watch the workspace (its log says why)"))
	}
	return s.cfg.Activity(ctx, stream.Send)
}
