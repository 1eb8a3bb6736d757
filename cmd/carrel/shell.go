package main

import (
	"errors"
	"os"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/supervisor/client"
)

func newShellCmd(g *globals) *cobra.Command {
	var user string
	c := &cobra.Command{
		Use:   "shell NAME",
		Short: "Open an interactive shell in a VM",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if !term.IsTerminal(int(os.Stdin.Fd())) {
				return errors.New("carrel shell needs a terminal; use carrel exec -i NAME -- sh for pipes")
			}
			req := &agentv1.ExecRequest{Argv: []string{"/bin/sh", "-l"}, User: user, Tty: true}
			return runSession(cmd.Context(), g, sessionFlags{interactive: true, tty: true}, client.Session{VM: args[0], Start: req})
		},
	}
	c.Flags().StringVarP(&user, "user", "u", "", "user name or uid in the guest (default agent)")
	return c
}
