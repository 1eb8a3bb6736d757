package main

import (
	"fmt"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

func newVMRemoveCmd(g *globals) *cobra.Command {
	var force bool
	c := &cobra.Command{
		Use:     "rm NAME",
		Aliases: []string{"delete"},
		Short:   "Remove a stopped VM and its state",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			_, err := g.client().VMs.DeleteVM(cmd.Context(), connect.NewRequest(&apiv1.DeleteVMRequest{Name: args[0], Force: force}))
			if err != nil {
				return err
			}
			fmt.Println(args[0], "removed")
			return nil
		},
	}
	c.Flags().BoolVarP(&force, "force", "f", false, "kill the VM first if it is running")
	return c
}
