package api

import (
	"context"
	"errors"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/policy"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
	"github.com/carrel-os/carrel/supervisor/gen/apiv1/apiv1connect"
	"github.com/carrel-os/carrel/supervisor/identity"
	"github.com/carrel-os/carrel/supervisor/policystore"
)

type policyService struct{ cfg Config }

var _ apiv1connect.PolicyServiceHandler = (*policyService)(nil)

func (s *policyService) store() (*policystore.Store, error) {
	if s.cfg.Policies == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("this carreld has no policy engine"))
	}
	return s.cfg.Policies, nil
}

func (s *policyService) ApplyPolicy(ctx context.Context, req *connect.Request[apiv1.ApplyPolicyRequest]) (*connect.Response[apiv1.ApplyPolicyResponse], error) {
	st, err := s.store()
	if err != nil {
		return nil, err
	}
	name := req.Msg.Name
	resp := &apiv1.ApplyPolicyResponse{}
	if len(req.Msg.Files) > 0 {
		b, err := bundleFrom(req.Msg.Files)
		if err != nil {
			return nil, err
		}
		_, results, err := st.Apply(ctx, name, b)
		resp.Tests = testResults(results)
		if err != nil {
			return nil, policyErr(err)
		}
		// Every running VM bound to the policy gets its new sandbox.
		var errs []error
		for _, v := range s.cfg.Manager.List() {
			if v.PolicyName() == name {
				errs = append(errs, s.cfg.Manager.ResyncSandbox(ctx, v.Name))
			}
		}
		if err := errors.Join(errs...); err != nil {
			return nil, connect.NewError(connect.CodeInternal, err)
		}
	} else if _, err := st.Get(name); err != nil {
		return nil, policyErr(err)
	}
	for _, vm := range req.Msg.Vms {
		if err := s.cfg.Manager.SetPolicy(ctx, vm, name); err != nil {
			return nil, toConnect(err)
		}
	}
	resp.Policy = s.describe(name)
	return connect.NewResponse(resp), nil
}

func (s *policyService) GetPolicy(ctx context.Context, req *connect.Request[apiv1.GetPolicyRequest]) (*connect.Response[apiv1.GetPolicyResponse], error) {
	st, err := s.store()
	if err != nil {
		return nil, err
	}
	p, err := st.Get(req.Msg.Name)
	if err != nil {
		return nil, policyErr(err)
	}
	resp := &apiv1.GetPolicyResponse{Policy: s.describe(req.Msg.Name)}
	if req.Msg.WithFiles {
		resp.Files = p.Bundle().Files
	}
	return connect.NewResponse(resp), nil
}

func (s *policyService) ListPolicies(ctx context.Context, req *connect.Request[apiv1.ListPoliciesRequest]) (*connect.Response[apiv1.ListPoliciesResponse], error) {
	st, err := s.store()
	if err != nil {
		return nil, err
	}
	resp := &apiv1.ListPoliciesResponse{}
	for _, info := range st.List() {
		resp.Policies = append(resp.Policies, s.describe(info.Name))
	}
	return connect.NewResponse(resp), nil
}

func (s *policyService) CheckPolicy(ctx context.Context, req *connect.Request[apiv1.CheckPolicyRequest]) (*connect.Response[apiv1.CheckPolicyResponse], error) {
	b, err := bundleFrom(req.Msg.Files)
	if err != nil {
		return nil, err
	}
	_, results, err := policy.Check(ctx, "check", b)
	resp := &apiv1.CheckPolicyResponse{Revision: b.Revision, Tests: testResults(results)}
	if err != nil {
		resp.Error = err.Error()
	}
	return connect.NewResponse(resp), nil
}

func (s *policyService) EvalPolicy(ctx context.Context, req *connect.Request[apiv1.EvalPolicyRequest]) (*connect.Response[apiv1.EvalPolicyResponse], error) {
	st, err := s.store()
	if err != nil {
		return nil, err
	}
	name := req.Msg.Policy
	if name == "" {
		name = policy.DefaultName
	}
	p, err := st.Get(name)
	if err != nil {
		return nil, policyErr(err)
	}
	in, err := policy.DecodeInput(policy.Kind(req.Msg.Kind), req.Msg.Input)
	if err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	// Evaluated, not enforced: the decision is returned, not recorded.
	d, err := p.Decide(ctx, in)
	if err != nil && !errors.Is(err, policy.ErrInvalidInput) {
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	return connect.NewResponse(&apiv1.EvalPolicyResponse{Decision: decisionProto(d)}), nil
}

func (s *policyService) ListDecisions(ctx context.Context, req *connect.Request[apiv1.ListDecisionsRequest]) (*connect.Response[apiv1.ListDecisionsResponse], error) {
	st, err := s.store()
	if err != nil {
		return nil, err
	}
	limit := int(req.Msg.Limit)
	if limit <= 0 || limit > 4096 {
		limit = 100
	}
	resp := &apiv1.ListDecisionsResponse{}
	for _, d := range st.Recent(req.Msg.Vm, limit, req.Msg.DeniedOnly) {
		resp.Decisions = append(resp.Decisions, decisionProto(d))
	}
	return connect.NewResponse(resp), nil
}

// describe returns a policy's listing with the VMs bound to it.
func (s *policyService) describe(name string) *apiv1.Policy {
	out := &apiv1.Policy{Name: name}
	for _, info := range s.cfg.Policies.List() {
		if info.Name == name {
			out.Revision, out.Builtin = info.Revision, info.Builtin
			if !info.AppliedAt.IsZero() {
				out.AppliedAt = info.AppliedAt.Format(time.RFC3339)
			}
		}
	}
	if s.cfg.Manager != nil {
		for _, v := range s.cfg.Manager.List() {
			if v.PolicyName() == name {
				out.Vms = append(out.Vms, v.Name)
			}
		}
	}
	return out
}

func bundleFrom(files map[string][]byte) (*policy.Bundle, error) {
	b, err := policy.FromFiles(files)
	if err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	return b, nil
}

func policyErr(err error) error {
	switch {
	case errors.Is(err, policy.ErrNoSuchPolicy):
		return connect.NewError(connect.CodeNotFound, err)
	case errors.Is(err, policy.ErrInvalidBundle), errors.Is(err, policystore.ErrInvalidName):
		return connect.NewError(connect.CodeInvalidArgument, err)
	}
	return connect.NewError(connect.CodeInternal, err)
}

func testResults(rs []policy.TestResult) []*apiv1.PolicyTestResult {
	out := make([]*apiv1.PolicyTestResult, len(rs))
	for i, r := range rs {
		out[i] = &apiv1.PolicyTestResult{Name: r.Name, Pass: r.Pass, Skip: r.Skip, Error: r.Error, DurationNs: int64(r.Duration)}
	}
	return out
}

func decisionProto(d policy.Decision) *apiv1.Decision {
	return &apiv1.Decision{
		Id: d.ID, Time: d.Time.Format(time.RFC3339Nano), Kind: string(d.Kind), Vm: d.VM,
		Policy: d.Policy, Revision: d.Revision, InputDigest: d.InputDigest,
		Allow: d.Allow, Rule: d.Rule, Reason: d.Reason,
	}
}

type tokenService struct{ cfg Config }

var _ apiv1connect.TokenServiceHandler = (*tokenService)(nil)

func (s *tokenService) tokens() (*identity.Tokens, error) {
	if s.cfg.Tokens == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("tokens are not enabled on this carreld"))
	}
	return s.cfg.Tokens, nil
}

func (s *tokenService) CreateToken(ctx context.Context, req *connect.Request[apiv1.CreateTokenRequest]) (*connect.Response[apiv1.CreateTokenResponse], error) {
	t, err := s.tokens()
	if err != nil {
		return nil, err
	}
	const maxTTL = 365 * 24 * time.Hour
	ttl := time.Duration(min(req.Msg.TtlSeconds, uint64(maxTTL/time.Second))) * time.Second
	var tok identity.Token
	var secret string
	if m := req.Msg; m.KeyName != "" {
		if m.Vm != "" {
			return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("an API key is not scoped to a VM: give key_name or vm, not both"))
		}
		if m.Policy != "" && s.cfg.Policies != nil {
			if _, err := s.cfg.Policies.Get(m.Policy); err != nil {
				return nil, connect.NewError(connect.CodeInvalidArgument, err)
			}
		}
		l := m.GetLimits()
		lim := identity.Limits{VMs: l.GetVms(), Snapshots: l.GetSnapshots(), MemoryBytes: l.GetMemoryBytes(), DiskBytes: l.GetDiskBytes()}
		tok, secret, err = t.CreateKey(identity.Key{Name: m.KeyName, Images: m.Images, Policy: m.Policy, Limits: lim}, ttl)
		if err != nil {
			return nil, connect.NewError(connect.CodeInvalidArgument, err)
		}
		return connect.NewResponse(&apiv1.CreateTokenResponse{Token: tokenProto(tok), Secret: secret}), nil
	}
	if l := req.Msg.GetLimits(); l.GetVms()|l.GetSnapshots()|l.GetMemoryBytes()|l.GetDiskBytes() != 0 {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("limits are an API key's (key_name): a VM token creates no VMs"))
	}
	if _, err := s.cfg.Manager.Get(req.Msg.Vm); err != nil {
		return nil, toConnect(err)
	}
	tok, secret, err = t.Create(req.Msg.Vm, ttl)
	if err != nil {
		return nil, connect.NewError(connect.CodeResourceExhausted, err)
	}
	return connect.NewResponse(&apiv1.CreateTokenResponse{Token: tokenProto(tok), Secret: secret}), nil
}

func (s *tokenService) ListTokens(ctx context.Context, req *connect.Request[apiv1.ListTokensRequest]) (*connect.Response[apiv1.ListTokensResponse], error) {
	t, err := s.tokens()
	if err != nil {
		return nil, err
	}
	resp := &apiv1.ListTokensResponse{}
	for _, tok := range t.List() {
		resp.Tokens = append(resp.Tokens, tokenProto(tok))
	}
	return connect.NewResponse(resp), nil
}

func (s *tokenService) RevokeToken(ctx context.Context, req *connect.Request[apiv1.RevokeTokenRequest]) (*connect.Response[apiv1.RevokeTokenResponse], error) {
	t, err := s.tokens()
	if err != nil {
		return nil, err
	}
	if err := t.Revoke(req.Msg.Id); err != nil {
		return nil, connect.NewError(connect.CodeNotFound, err)
	}
	return connect.NewResponse(&apiv1.RevokeTokenResponse{}), nil
}

func tokenProto(t identity.Token) *apiv1.Token {
	out := &apiv1.Token{Id: t.ID, Vm: t.VM, CreatedAt: t.CreatedAt.Format(time.RFC3339)}
	if k := t.Key; k != nil {
		out.KeyName, out.Images, out.Policy = k.Name, k.Images, k.Policy
		if l := k.Limits; l != (identity.Limits{}) {
			out.Limits = &apiv1.KeyLimits{Vms: l.VMs, Snapshots: l.Snapshots, MemoryBytes: l.MemoryBytes, DiskBytes: l.DiskBytes}
		}
	}
	if !t.ExpiresAt.IsZero() {
		out.ExpiresAt = t.ExpiresAt.Format(time.RFC3339)
	}
	return out
}
