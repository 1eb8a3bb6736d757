//go:build linux

package server

import (
	"context"
	"errors"

	"connectrpc.com/connect"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/sandbox"
)

// SetSandbox puts the host's sandbox into force; see sandbox.Guard.Set.
// CodeInvalidArgument for a request that fails validation, CodeInternal if
// the Landlock ruleset cannot be built; either way the previous sandbox
// stays.
func (s *service) SetSandbox(_ context.Context, req *connect.Request[agentv1.SetSandboxRequest]) (*connect.Response[agentv1.SetSandboxResponse], error) {
	m := req.Msg
	log := s.cfg.Log.With("rpc", "SetSandbox", "revision", truncate(m.GetRevision()),
		"read_write", len(m.GetReadWrite()), "read_only", len(m.GetReadOnly()), "denied", len(m.GetDenied()))
	st, err := s.cfg.Sandbox.Set(sandbox.Policy{
		ReadWrite: m.GetReadWrite(),
		ReadOnly:  m.GetReadOnly(),
		Denied:    m.GetDenied(),
		Revision:  m.GetRevision(),
	})
	if err != nil {
		log.Warn("sandbox refused; the previous one stays", "err", err)
		if errors.Is(err, sandbox.ErrInvalid) {
			return nil, connect.NewError(connect.CodeInvalidArgument, err)
		}
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	log.Info("sandbox set", "landlock", st.Landlock, "landlock_abi", st.ABI, "detail", st.Detail)
	return connect.NewResponse(&agentv1.SetSandboxResponse{
		Landlock:    st.Landlock,
		LandlockAbi: int32(st.ABI),
		Detail:      st.Detail,
	}), nil
}
