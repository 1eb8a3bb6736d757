package main

import (
	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/supervisor/client"
)

type globals struct {
	socket string
	token  string
}

func (g *globals) client() *client.Client {
	if g.token != "" {
		return client.New(g.socket, client.WithToken(g.token))
	}
	return client.New(g.socket)
}

// version is carrel's version, set by the build (make build: git describe).
var version = "dev"

func newRootCmd() *cobra.Command {
	g := &globals{}
	root := &cobra.Command{
		Use:           "carrel",
		Short:         "Run AI agents in their own VMs, with hard walls and a full record",
		Version:       version,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.PersistentFlags().StringVar(&g.socket, "socket", client.SocketFromEnv(), "carreld's API socket (env CARREL_SOCKET)")
	root.PersistentFlags().StringVar(&g.token, "token", client.TokenFromEnv(), "call as the holder of this token instead of as the local user (env CARREL_TOKEN)")
	root.AddCommand(newVMCmd(g), newExecCmd(g), newAttachCmd(g), newShellCmd(g), newPsCmd(g), newKillCmd(g), newCpCmd(g), newWatchCmd(g), newPortForwardCmd(g), newImageCmd(g), newInfoCmd(g),
		newPolicyCmd(g), newTokenCmd(g), newKeyCmd(g), newAuditCmd(g), newWitnessCmd(), newGPUCmd(g), newMCPCmd(g), newFleetCmd())
	return root
}
