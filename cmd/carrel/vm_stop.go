package main

import (
	"fmt"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

func newVMStopCmd(g *globals) *cobra.Command {
	var force bool
	c := &cobra.Command{
		Use:   "stop NAME",
		Short: "Power a VM off (the guest gets a grace period unless --force)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := g.client().VMs.StopVM(cmd.Context(), connect.NewRequest(&apiv1.StopVMRequest{Name: args[0], Force: force}))
			if err != nil {
				return err
			}
			fmt.Println(resp.Msg.Vm.Name, stateName(resp.Msg.Vm.State))
			return nil
		},
	}
	c.Flags().BoolVarP(&force, "force", "f", false, "kill the VM at once")
	return c
}
