package main

import (
	"fmt"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/supervisor/console"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

func newVMConsoleCmd(g *globals) *cobra.Command {
	var size uint32
	var raw bool
	c := &cobra.Command{
		Use:   "console NAME",
		Short: "Print the end of a VM's serial console log (its kernel's messages and what else the guest printed there)",
		Long: "Print the last bytes of the VM's serial console log, across its boots, running or not. The guest\n" +
			"wrote them: escape sequences and other control characters are taken out unless --raw.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := g.client().VMs.GetConsole(cmd.Context(), connect.NewRequest(&apiv1.GetConsoleRequest{Name: args[0], MaxBytes: size}))
			if err != nil {
				return err
			}
			if resp.Msg.Truncated {
				fmt.Fprintf(cmd.ErrOrStderr(), "(the last %d bytes of the console log)\n", len(resp.Msg.Data))
			}
			if raw {
				_, err = cmd.OutOrStdout().Write(resp.Msg.Data)
				return err
			}
			_, err = fmt.Fprint(cmd.OutOrStdout(), console.Printable(resp.Msg.Data))
			return err
		},
	}
	c.Flags().Uint32Var(&size, "bytes", 64<<10, "print the last this many bytes (1 MiB at most)")
	c.Flags().BoolVar(&raw, "raw", false, "print the guest's bytes as they are")
	return c
}
