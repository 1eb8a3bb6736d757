package main

import (
	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

func newInfoCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "info",
		Short: "Show carreld's version, accelerator and VM count as JSON",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := g.client().System.GetInfo(cmd.Context(), connect.NewRequest(&apiv1.GetInfoRequest{}))
			if err != nil {
				return err
			}
			return printJSON(cmd.OutOrStdout(), resp.Msg)
		},
	}
}
