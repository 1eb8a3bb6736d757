package policies

import (
	"context"
	"fmt"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/supervisor/agentlink"
	"github.com/carrel-os/carrel/supervisor/registry"
)

// GiveSandbox sends a VM's guest the sandbox its policy derives: the fs
// roots the agent's file service and, under Landlock, its commands stay
// within. It is the VM manager's AgentReady hook.
func (s *Store) GiveSandbox(ctx context.Context, rec registry.Record, link *agentlink.Link) error {
	p, err := s.Get(rec.PolicyName())
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
	log := s.log.With("vm", rec.Name, "policy", p.Name, "revision", p.Revision)
	if resp.Msg.Landlock {
		log.Info("guest sandbox set", "landlock_abi", resp.Msg.LandlockAbi)
	} else {
		// The host still decides every call; only the in-guest layer is
		// missing, and the operator should know.
		log.Warn("guest sandbox set without landlock", "detail", resp.Msg.Detail)
	}
	return nil
}
