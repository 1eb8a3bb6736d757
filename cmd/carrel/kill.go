package main

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"
)

func newKillCmd(g *globals) *cobra.Command {
	var sig string
	c := &cobra.Command{
		Use:   "kill NAME PID",
		Short: "Send a signal (default SIGTERM) to a process in a VM",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			pid, err := strconv.ParseInt(args[1], 10, 32)
			if err != nil || pid <= 0 {
				return fmt.Errorf("invalid pid %q", args[1])
			}
			n, err := parseSignal(sig)
			if err != nil {
				return err
			}
			return g.client().Signal(cmd.Context(), args[0], int32(pid), n)
		},
	}
	c.Flags().StringVarP(&sig, "signal", "s", "TERM", "signal name (TERM, SIGKILL, ...) or number")
	return c
}

func parseSignal(s string) (int32, error) {
	if n, err := strconv.Atoi(s); err == nil && n > 0 && n < 65 {
		return int32(n), nil
	}
	name := strings.ToUpper(s)
	if !strings.HasPrefix(name, "SIG") {
		name = "SIG" + name
	}
	if n := unix.SignalNum(name); n != 0 {
		return int32(n), nil
	}
	return 0, fmt.Errorf("unknown signal %q", s)
}
