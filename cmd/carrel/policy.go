package main

import (
	"fmt"
	"slices"
	"strings"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

func newPolicyCmd(g *globals) *cobra.Command {
	c := &cobra.Command{
		Use:   "policy",
		Short: "Test, check, evaluate, apply and list policies (see docs/policy.md)",
	}
	c.AddCommand(newPolicyTestCmd(), newPolicyCheckCmd(), newPolicyEvalCmd(g), newPolicyApplyCmd(g),
		newPolicyListCmd(g), newPolicyShowCmd(g), newPolicyDecisionsCmd(g))
	return c
}

func newPolicyListCmd(g *globals) *cobra.Command {
	var output string
	c := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List the policies carreld has, and the VMs bound to each",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return err
			}
			resp, err := g.client().Policies.ListPolicies(cmd.Context(), connect.NewRequest(&apiv1.ListPoliciesRequest{}))
			if err != nil {
				return err
			}
			if output == "json" {
				return printJSON(cmd.OutOrStdout(), resp.Msg)
			}
			w := newTable()
			fmt.Fprintln(w, "NAME\tREVISION\tSOURCE\tAPPLIED\tVMS")
			for _, p := range resp.Msg.Policies {
				src := "applied"
				if p.Builtin && p.AppliedAt == "" {
					src = "built-in"
				}
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\n", p.Name, short(p.Revision), src, dash(p.AppliedAt), dash(strings.Join(p.Vms, ",")))
			}
			return w.Flush()
		},
	}
	addOutputFlag(c, &output)
	return c
}

func newPolicyShowCmd(g *globals) *cobra.Command {
	var output string
	var files bool
	c := &cobra.Command{
		Use:   "show NAME",
		Short: "Show a policy; with --files, print its bundle's files",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return err
			}
			resp, err := g.client().Policies.GetPolicy(cmd.Context(), connect.NewRequest(&apiv1.GetPolicyRequest{Name: args[0], WithFiles: files}))
			if err != nil {
				return err
			}
			if output == "json" {
				return printJSON(cmd.OutOrStdout(), resp.Msg)
			}
			p := resp.Msg.Policy
			fmt.Printf("name:     %s\nrevision: %s\nbuilt-in: %v\napplied:  %s\nvms:      %s\n", p.Name, p.Revision, p.Builtin, dash(p.AppliedAt), dash(strings.Join(p.Vms, ", ")))
			names := make([]string, 0, len(resp.Msg.Files))
			for n := range resp.Msg.Files {
				names = append(names, n)
			}
			slices.Sort(names)
			for _, n := range names {
				fmt.Printf("\n# --- %s ---\n%s", n, resp.Msg.Files[n])
			}
			return nil
		},
	}
	c.Flags().BoolVar(&files, "files", false, "print the bundle's Rego and data files")
	addOutputFlag(c, &output)
	return c
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
