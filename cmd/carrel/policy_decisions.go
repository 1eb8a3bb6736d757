package main

import (
	"fmt"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

func newPolicyDecisionsCmd(g *globals) *cobra.Command {
	var vm, output string
	var denied bool
	var limit uint32
	c := &cobra.Command{
		Use:   "decisions",
		Short: "List carreld's most recent policy decisions, oldest first",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return err
			}
			resp, err := g.client().Policies.ListDecisions(cmd.Context(), connect.NewRequest(&apiv1.ListDecisionsRequest{Vm: vm, Limit: limit, DeniedOnly: denied}))
			if err != nil {
				return err
			}
			if output == "json" {
				return printJSON(cmd.OutOrStdout(), resp.Msg)
			}
			w := newTable()
			fmt.Fprintln(w, "TIME\tKIND\tVM\tRESULT\tRULE\tREASON")
			for _, d := range resp.Msg.Decisions {
				res := "deny"
				if d.Allow {
					res = "allow"
				}
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\n", d.Time, d.Kind, dash(d.Vm), res, d.Rule, d.Reason)
			}
			return w.Flush()
		},
	}
	c.Flags().StringVar(&vm, "vm", "", "only this VM's decisions")
	c.Flags().BoolVar(&denied, "denied", false, "only denies")
	c.Flags().Uint32VarP(&limit, "limit", "n", 100, "at most this many")
	addOutputFlag(c, &output)
	return c
}
