package main

import (
	"errors"
	"fmt"
	"os"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

// exitCarrelError is the exit code when carrel itself fails, so that it
// cannot be mistaken for the command's own status (as docker exec does).
const exitCarrelError = 125

func newExecCmd(g *globals) *cobra.Command {
	var env []string
	var cwd string
	var timeout time.Duration
	c := &cobra.Command{
		Use:   "exec NAME -- CMD [ARG...]",
		Short: "Run a command in a VM; streams its output and exits with its exit code",
		Args:  cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if cmd.ArgsLenAtDash() != 1 {
				return errors.New("usage: carrel exec NAME -- CMD [ARG...]")
			}
			req := &apiv1.ExecRequest{Vm: args[0], Argv: args[1:], Env: env, Cwd: cwd, TimeoutSeconds: uint32(timeout / time.Second)}
			code, err := runExec(cmd, g, req)
			if err != nil {
				fmt.Fprintln(os.Stderr, "carrel:", describe(err))
				return exitError{exitCarrelError}
			}
			if code != 0 {
				return exitError{code}
			}
			return nil
		},
	}
	c.Flags().StringArrayVarP(&env, "env", "e", nil, "set KEY=VALUE in the command's environment (repeatable)")
	c.Flags().StringVarP(&cwd, "cwd", "w", "", "working directory in the guest (default /workspace)")
	c.Flags().DurationVar(&timeout, "timeout", 0, "kill the command after this long (default 10m)")
	return c
}

func runExec(cmd *cobra.Command, g *globals, req *apiv1.ExecRequest) (int, error) {
	stream, err := g.client().VMs.Exec(cmd.Context(), connect.NewRequest(req))
	if err != nil {
		return 0, err
	}
	defer stream.Close()
	for stream.Receive() {
		switch e := stream.Msg().Event.(type) {
		case *apiv1.ExecResponse_Stdout:
			if _, err := os.Stdout.Write(e.Stdout); err != nil {
				return 0, err
			}
		case *apiv1.ExecResponse_Stderr:
			if _, err := os.Stderr.Write(e.Stderr); err != nil {
				return 0, err
			}
		case *apiv1.ExecResponse_Exit:
			return int(e.Exit.Code), nil
		}
	}
	if err := stream.Err(); err != nil {
		return 0, err
	}
	return 0, errors.New("the stream ended without an exit status")
}
