package main

import (
	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/supervisor/client"
)

func newAttachCmd(g *globals) *cobra.Command {
	var sf sessionFlags
	c := &cobra.Command{
		Use:   "attach NAME ID",
		Short: "Attach to a command started with exec --detach: its buffered output, then live",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runSession(cmd.Context(), g, sf, client.Session{VM: args[0], Attach: args[1]})
		},
	}
	sf.add(c)
	return c
}
