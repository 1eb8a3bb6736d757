package client_test

import (
	"bytes"
	"context"
	"fmt"
	"log"
	"os"
	"strings"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/supervisor/client"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

// An agent harness creates a VM, runs a command in it and reads a file
// back, as carrel does.
func Example() {
	ctx := context.Background()
	c := client.New(client.SocketFromEnv())

	if _, err := c.VMs.CreateVM(ctx, connect.NewRequest(&apiv1.CreateVMRequest{Name: "task-42", Image: "dev"})); err != nil {
		log.Fatal(err)
	}
	defer c.VMs.DeleteVM(ctx, connect.NewRequest(&apiv1.DeleteVMRequest{Name: "task-42", Force: true}))

	if _, err := c.Upload(ctx, "task-42", "/workspace/input.txt", strings.NewReader("hello\n"), 0o644); err != nil {
		log.Fatal(err)
	}
	status, err := c.Run(ctx, client.Session{
		VM:     "task-42",
		Start:  &agentv1.ExecRequest{Argv: []string{"sh", "-c", "tr a-z A-Z < input.txt > output.txt"}},
		Stdout: os.Stdout,
		Stderr: os.Stderr,
	})
	if err != nil {
		log.Fatal(err)
	}
	var out bytes.Buffer
	if _, err := c.Download(ctx, "task-42", "/workspace/output.txt", &out); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("exit %d: %s", status.Code, out.String())
}

// A command fed from stdin, as `carrel exec -i` does.
func ExampleClient_Run_stdin() {
	c := client.New(client.SocketFromEnv())
	status, err := c.Run(context.Background(), client.Session{
		VM:     "task-42",
		Start:  &agentv1.ExecRequest{Argv: []string{"wc", "-l"}},
		Stdin:  strings.NewReader("one\ntwo\n"),
		Stdout: os.Stdout,
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("exit", status.Code)
}

// Long jobs can be detached and attached to later, as `carrel exec
// --detach` and `carrel attach` do.
func ExampleClient_Run_detach() {
	ctx := context.Background()
	c := client.New(client.SocketFromEnv())
	var id string
	_, err := c.Run(ctx, client.Session{
		VM:               "task-42",
		Start:            &agentv1.ExecRequest{Argv: []string{"make", "-C", "/workspace/src"}, Detach: true},
		Started:          func(execID string, _ int32) { id = execID },
		DetachAfterStart: true,
	})
	if err != client.ErrDetached {
		log.Fatal(err)
	}
	// ... later: the output kept meanwhile, then live output and the exit.
	status, err := c.Run(ctx, client.Session{VM: "task-42", Attach: id, Stdout: os.Stdout, Stderr: os.Stderr})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("make exited", status.Code)
}

// Directories travel as tar streams; what comes from the guest is
// extracted beneath the destination and nowhere else.
func ExampleClient_DownloadTree() {
	c := client.New(client.SocketFromEnv())
	st, err := c.DownloadTree(context.Background(), "task-42", "/workspace/results", "./out", nil)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(st.Entries, "entries,", st.Bytes, "bytes")
}
