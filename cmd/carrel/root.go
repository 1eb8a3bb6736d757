package main

import (
	"context"
	"net"
	"os"

	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/supervisor/client"
)

type globals struct {
	socket string
	token  string
	// host, when set, is a remote host whose carreld is reached over ssh
	// (remote.go); socket is then the API socket's path there.
	host      string
	socketSet bool
}

func (g *globals) client() *client.Client {
	var opts []client.Option
	if g.token != "" {
		opts = append(opts, client.WithToken(g.token))
	}
	if g.host != "" {
		remoteSocket := ""
		if g.socketSet {
			remoteSocket = g.socket
		}
		dial, err := sshDialer(g.host, remoteSocket)
		if err != nil {
			dial = func(context.Context) (net.Conn, error) { return nil, err }
		}
		opts = append(opts, client.WithDialer(dial))
	}
	return client.New(g.socket, opts...)
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
	root.PersistentFlags().StringVar(&g.host, "host", os.Getenv("CARREL_HOST"), "reach the carreld of another host over ssh: ssh://[user@]host[:port] or an ssh destination, such as the host a fleet AgentVM runs on (env CARREL_HOST); --socket is then the socket there")
	root.PersistentPreRun = func(cmd *cobra.Command, _ []string) { g.socketSet = cmd.Flags().Changed("socket") }
	root.AddCommand(newVMCmd(g), newExecCmd(g), newAttachCmd(g), newShellCmd(g), newPsCmd(g), newKillCmd(g), newCpCmd(g), newWatchCmd(g), newPortForwardCmd(g), newImageCmd(g), newInfoCmd(g),
		newPolicyCmd(g), newTokenCmd(g), newKeyCmd(g), newAuditCmd(g), newWitnessCmd(), newGPUCmd(g), newMCPCmd(g), newFleetCmd(), newSystemCmd(g))
	return root
}
