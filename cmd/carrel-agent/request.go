//go:build linux

package main

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/carrel-os/carrel/guest-agent/requests"
)

// request asks the host for something through the running agent:
//
//	carrel-agent request checkpoint --name NAME [--note TEXT]
//
// It prints the host's answer and exits 0 if the request was allowed and
// done, 1 if it was denied or failed, 2 for bad usage.
func request(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] != requests.KindCheckpoint {
		fmt.Fprintln(stderr, "usage: carrel-agent request checkpoint --name NAME [--note TEXT]")
		return 2
	}
	fs := flag.NewFlagSet("carrel-agent request checkpoint", flag.ContinueOnError)
	fs.SetOutput(stderr)
	name := fs.String("name", "", "the checkpoint's name: 1-63 lower-case letters, digits and '-'")
	note := fs.String("note", "", "words to keep with it")
	socket := fs.String("socket", requests.SocketPath, "the agent's request socket")
	if err := fs.Parse(args[1:]); err != nil {
		return 2
	}
	if *name == "" || fs.NArg() != 0 {
		fmt.Fprintln(stderr, "usage: carrel-agent request checkpoint --name NAME [--note TEXT]")
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), requests.AnswerTimeout+10e9)
	defer cancel()
	a, err := requests.Send(ctx, *socket, requests.Request{Kind: requests.KindCheckpoint, Name: *name, Note: *note})
	switch {
	case err != nil:
		fmt.Fprintln(stderr, "carrel-agent request:", err)
		return 1
	case a.Error != "":
		fmt.Fprintln(stderr, "carrel-agent request:", a.Error)
		return 1
	case !a.Allowed:
		fmt.Fprintln(stderr, "denied:", a.Reason)
		return 1
	case !a.Done:
		fmt.Fprintln(stderr, "allowed, but it failed:", a.Reason)
		return 1
	}
	fmt.Fprintln(stdout, a.Reason)
	return 0
}
