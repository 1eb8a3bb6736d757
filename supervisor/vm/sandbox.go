package vm

import (
	"context"
	"fmt"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/supervisor/agentlink"
	"github.com/carrel-os/carrel/supervisor/registry"
)

// Policies finds a policy by name: the policy store (supervisor/policystore).
type Policies interface {
	Get(name string) (*policy.Policy, error)
}

// giveSandbox sends a VM's guest the sandbox its policy derives: the fs
// roots the agent's file service and, under Landlock, its commands stay
// within. Without Config.Policies there is none to give.
func (m *Manager) giveSandbox(ctx context.Context, rec registry.Record, link *agentlink.Link) error {
	if m.cfg.Policies == nil {
		return nil
	}
	p, err := m.cfg.Policies.Get(rec.PolicyName())
	if err != nil {
		return err
	}
	sb, err := p.Sandbox(ctx, rec.Name)
	if err != nil {
		return err
	}
	c, done := link.Agent()
	resp, err := c.SetSandbox(ctx, connect.NewRequest(&agentv1.SetSandboxRequest{
		ReadWrite: sb.ReadWrite, ReadOnly: sb.ReadOnly, Denied: sb.Denied, Revision: p.Revision,
	}))
	if err != nil {
		return fmt.Errorf("set the guest's sandbox: %w", done(ctx, err))
	}
	landlock, abi, detail := checkSandboxReply(resp.Msg)
	log := m.log.With("vm", rec.Name, "policy", p.Name, "revision", p.Revision)
	if landlock {
		log.Info("guest sandbox set", "landlock_abi", abi)
	} else {
		// The host still decides every call; only the in-guest layer is
		// missing, and the operator should know.
		log.Warn("guest sandbox set without landlock", "detail", detail)
	}
	return nil
}

// maxSandboxDetail caps the guest's words about its sandbox in our log.
const maxSandboxDetail = 256

// checkSandboxReply reads what the guest says of its sandbox, which is
// only ever logged: an ABI outside what Landlock has is reported as none,
// and the detail is cut to maxSandboxDetail bytes of printable UTF-8.
func checkSandboxReply(r *agentv1.SetSandboxResponse) (landlock bool, abi int32, detail string) {
	abi = r.GetLandlockAbi()
	landlock = r.GetLandlock() && abi >= 1 && abi <= 64
	if !landlock {
		abi = 0
	}
	return landlock, abi, protocol.CleanText(r.GetDetail(), maxSandboxDetail)
}
