package main

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/policy/bundle"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

func newPolicyApplyCmd(g *globals) *cobra.Command {
	var vms []string
	c := &cobra.Command{
		Use:   "apply NAME [DIR] [--vm VM]...",
		Short: "Install or replace a policy from DIR, and/or bind VMs to it, atomically",
		Long: "With DIR, the bundle is checked by carreld (strict compile, required rules, its\n" +
			"Rego tests) and only then replaces policy NAME for every VM bound to it; a bundle\n" +
			"that fails changes nothing. With --vm, those VMs are bound to NAME. Running VMs'\n" +
			"guests get the new sandbox at once.",
		Args: cobra.RangeArgs(1, 2),
		RunE: func(cmd *cobra.Command, args []string) error {
			req := &apiv1.ApplyPolicyRequest{Name: args[0], Vms: vms}
			if len(args) == 2 {
				b, err := bundle.Load(args[1])
				if err != nil {
					return err
				}
				req.Files = b.Files
			} else if len(vms) == 0 {
				return errors.New("give a bundle directory, or --vm to bind VMs to the policy")
			}
			resp, err := g.client().Policies.ApplyPolicy(cmd.Context(), connect.NewRequest(req))
			if err != nil {
				return err
			}
			p := resp.Msg.Policy
			if len(resp.Msg.Tests) > 0 {
				fmt.Printf("%d tests passed\n", len(resp.Msg.Tests))
			}
			fmt.Printf("policy %s is revision %s", p.Name, short(p.Revision))
			if len(p.Vms) > 0 {
				slices.Sort(p.Vms)
				fmt.Printf(", bound to %s", strings.Join(p.Vms, ", "))
			}
			fmt.Println()
			return nil
		},
	}
	c.Flags().StringSliceVar(&vms, "vm", nil, "bind this VM to the policy (repeatable)")
	return c
}
