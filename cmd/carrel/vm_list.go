package main

import (
	"fmt"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

func newVMListCmd(g *globals) *cobra.Command {
	var output string
	c := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List VMs",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return err
			}
			resp, err := g.client().VMs.ListVMs(cmd.Context(), connect.NewRequest(&apiv1.ListVMsRequest{}))
			if err != nil {
				return err
			}
			if output == "json" {
				return printJSON(cmd.OutOrStdout(), resp.Msg)
			}
			w := newTable()
			fmt.Fprintln(w, "NAME\tSTATE\tAGENT\tCPUS\tMEMORY\tIMAGE\tPOLICY\tSESSION\tPID")
			for _, v := range resp.Msg.Vms {
				state := stateName(v.State)
				switch {
				case v.Held:
					state += " (held)"
				case v.Paused:
					state += " (paused)"
				}
				fmt.Fprintf(w, "%s\t%s\t%s\t%d\t%dM\t%s\t%s\t%s\t%d\n", v.Name, state, agentName(v.AgentState), v.Cpus, v.MemoryBytes>>20, short(v.ImageDigest), v.Policy, v.Session, v.Pid)
			}
			return w.Flush()
		},
	}
	addOutputFlag(c, &output)
	return c
}

func newVMInspectCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "inspect NAME",
		Short: "Show one VM as JSON",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := g.client().VMs.GetVM(cmd.Context(), connect.NewRequest(&apiv1.GetVMRequest{Name: args[0]}))
			if err != nil {
				return err
			}
			return printJSON(cmd.OutOrStdout(), resp.Msg.Vm)
		},
	}
}
