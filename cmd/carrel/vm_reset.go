package main

import (
	"fmt"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

func newVMResetCmd(g *globals) *cobra.Command {
	var workspace bool
	c := &cobra.Command{
		Use:   "reset NAME",
		Short: "Discard what a VM changed outside /workspace: it boots its verified image as built",
		Long: "Discard the VM's writable layer over its image's verified root: every package it installed and " +
			"every file it changed outside /workspace. /workspace is kept unless --workspace. A running VM is " +
			"stopped first and booted again.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := g.client().VMs.ResetVM(cmd.Context(), connect.NewRequest(&apiv1.ResetVMRequest{Name: args[0], Workspace: workspace}))
			if err != nil {
				return err
			}
			v := resp.Msg.Vm
			fmt.Printf("%s reset, %s (image %s)\n", v.Name, stateName(v.State), short(v.ImageDigest))
			return nil
		},
	}
	c.Flags().BoolVar(&workspace, "workspace", false, "discard /workspace too")
	return c
}
