package main

import (
	"fmt"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

func newVMStartCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "start NAME",
		Short: "Boot a stopped VM",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := g.client().VMs.StartVM(cmd.Context(), connect.NewRequest(&apiv1.StartVMRequest{Name: args[0]}))
			if err != nil {
				return err
			}
			fmt.Println(resp.Msg.Vm.Name, stateName(resp.Msg.Vm.State))
			return nil
		},
	}
}
