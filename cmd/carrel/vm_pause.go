package main

import (
	"fmt"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

func newVMPauseCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "pause NAME",
		Short: "Stop a VM's vCPUs, keeping its memory, until carrel vm resume",
		Long: "Stop the VM's vCPUs. Its memory, devices and disks are kept as they are, calls into it are refused " +
			"until it is resumed, and it stays paused across carreld restarts. The audit log records both steps.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := g.client().VMs.PauseVM(cmd.Context(), connect.NewRequest(&apiv1.PauseVMRequest{Name: args[0]}))
			if err != nil {
				return err
			}
			fmt.Println(resp.Msg.Vm.Name, "paused")
			return nil
		},
	}
}

func newVMResumeCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "resume NAME",
		Short: "Start the vCPUs of a paused VM again",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := g.client().VMs.ResumeVM(cmd.Context(), connect.NewRequest(&apiv1.ResumeVMRequest{Name: args[0]}))
			if err != nil {
				return err
			}
			v := resp.Msg.Vm
			if v.Held {
				fmt.Println(v.Name, "resumed by its operator, but held paused by carreld until its audit log can be written")
				return nil
			}
			fmt.Println(v.Name, "running")
			return nil
		},
	}
}
