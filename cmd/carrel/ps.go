package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

func newPsCmd(g *globals) *cobra.Command {
	var output string
	c := &cobra.Command{
		Use:   "ps NAME",
		Short: "List the processes in a VM",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return err
			}
			ps, err := g.client().ListProcesses(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if output == "json" {
				return printJSON(cmd.OutOrStdout(), &agentv1.ListProcessesResponse{Processes: ps})
			}
			w := newTable()
			fmt.Fprintln(w, "PID\tPPID\tUID\tSTAT\tRSS\tEXEC ID\tCOMMAND")
			for _, p := range ps {
				fmt.Fprintf(w, "%d\t%d\t%d\t%s\t%dK\t%s\t%s\n", p.Pid, p.Ppid, p.Uid, p.State, p.RssBytes>>10, p.ExecId, p.Command)
			}
			return w.Flush()
		},
	}
	addOutputFlag(c, &output)
	return c
}
