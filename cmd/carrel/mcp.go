package main

import (
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/supervisor/mcpserver"
)

func newMCPCmd(g *globals) *cobra.Command {
	var vm string
	cmd := &cobra.Command{
		Use:   "mcp [--vm NAME]",
		Short: "Serve carrel's tools to an agent over MCP (stdio)",
		Long: `mcp serves carrel's tools to an agent over the Model Context Protocol, on stdin and stdout:
exec, read_file, write_file, list_dir, stat, make_dir, remove, move and vm_list.

Each tool is an ordinary call to carreld, made as the caller of carrel mcp (the local user, or --token's
holder): the VM's policy decides it and the audit log records it. With --vm the tools act on that VM only;
without, each call names its VM.

An agent's MCP configuration runs it as a command, e.g. {"command": "carrel", "args": ["mcp", "--vm", "dev"]}.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if vm != "" {
				if err := client.ValidVMName(vm); err != nil {
					return err
				}
			}
			s := mcpserver.New(g.client(), mcpserver.Config{VM: vm, Version: version})
			return s.Run(cmd.Context(), &mcp.StdioTransport{})
		},
	}
	cmd.Flags().StringVar(&vm, "vm", "", "act on this VM only")
	return cmd
}
