// Command carrel is the CLI for carreld: VMs, images and commands in VMs.
package main

import (
	"errors"
	"fmt"
	"os"

	"connectrpc.com/connect"
)

func main() {
	root := newRootCmd()
	err := root.Execute()
	if err == nil {
		return
	}
	var ee exitError
	if errors.As(err, &ee) {
		os.Exit(ee.code)
	}
	fmt.Fprintln(os.Stderr, "carrel:", describe(err))
	os.Exit(1)
}

// exitError carries an exit code to main (e.g. the exit code of a command
// run with `carrel exec`) without printing anything.
type exitError struct{ code int }

func (e exitError) Error() string { return fmt.Sprintf("exit status %d", e.code) }

// describe turns an RPC error into a message for people. Unavailable is
// carreld out of reach only when carreld did not send it: carreld itself
// answers Unavailable when its audit log cannot be written, or when it
// ended a call because it paused the VM, and says why.
func describe(err error) string {
	var ce *connect.Error
	if errors.As(err, &ce) {
		if ce.Code() == connect.CodeUnavailable && !connect.IsWireError(ce) {
			return "cannot reach carreld (is it running? set CARREL_SOCKET or --socket): " + ce.Message()
		}
		return ce.Message()
	}
	return err.Error()
}
