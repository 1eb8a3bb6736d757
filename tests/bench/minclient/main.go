// Command minclient is the floor for the CLI in make bench: the smallest Go
// program that runs a command in a VM with carrel's client (client.New,
// then one Run), with no flags, no cobra and nothing else linked. What
// `carrel exec` costs over it is the CLI's own; what it costs over a warm
// client's Run is any new Go process and connection on this machine.
//
//	CARREL_SOCKET=/run/carrel/carrel.sock minclient VM CMD [ARG...]
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/supervisor/client"
)

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: minclient VM CMD [ARG...]")
		os.Exit(2)
	}
	c := client.New(os.Getenv("CARREL_SOCKET"))
	st, err := c.Run(context.Background(), client.Session{VM: os.Args[1],
		Start: &agentv1.ExecRequest{Argv: os.Args[2:], NoStdin: true}, Stdout: os.Stdout, Stderr: os.Stderr})
	if err != nil {
		fmt.Fprintln(os.Stderr, "minclient:", err)
		os.Exit(125)
	}
	os.Exit(int(st.Code))
}
