//go:build linux

package server

import (
	"context"
	"errors"

	"connectrpc.com/connect"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

// GuestRequests hands the guest's requests to carreld (package requests).
func (s *service) GuestRequests(ctx context.Context, _ *connect.Request[agentv1.GuestRequestsRequest], out *connect.ServerStream[agentv1.GuestRequest]) error {
	if s.cfg.Requests == nil {
		return connect.NewError(connect.CodeUnimplemented, errors.New("this agent takes no guest requests"))
	}
	return s.cfg.Requests.Serve(ctx, out.Send)
}

// AnswerGuestRequest gives carreld's answer to the request's asker.
func (s *service) AnswerGuestRequest(_ context.Context, req *connect.Request[agentv1.GuestAnswer]) (*connect.Response[agentv1.GuestAnswerResponse], error) {
	if s.cfg.Requests == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("this agent takes no guest requests"))
	}
	if err := s.cfg.Requests.Answer(req.Msg); err != nil {
		return nil, err
	}
	return connect.NewResponse(&agentv1.GuestAnswerResponse{}), nil
}
