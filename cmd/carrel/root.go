package main

import (
	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/supervisor/client"
)

type globals struct {
	socket string
}

func (g *globals) client() *client.Client { return client.New(g.socket) }

func newRootCmd() *cobra.Command {
	g := &globals{}
	root := &cobra.Command{
		Use:           "carrel",
		Short:         "Run AI agents in their own VMs, with hard walls and a full record",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.PersistentFlags().StringVar(&g.socket, "socket", client.SocketFromEnv(), "carreld's API socket (env CARREL_SOCKET)")
	root.AddCommand(newVMCmd(g), newExecCmd(g), newAttachCmd(g), newShellCmd(g), newPsCmd(g), newKillCmd(g), newCpCmd(g), newWatchCmd(g), newPortForwardCmd(g), newImageCmd(g), newInfoCmd(g))
	return root
}
