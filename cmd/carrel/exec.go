package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/supervisor/client"
)

// exitCarrelError is the exit code when carrel itself fails, so that it
// cannot be mistaken for the command's own status (as docker exec does).
const exitCarrelError = 125

// sessionFlags are the flags exec, attach and shell share.
type sessionFlags struct {
	interactive, tty bool
}

func (f *sessionFlags) add(c *cobra.Command) {
	c.Flags().BoolVarP(&f.interactive, "interactive", "i", false, "stream stdin to the command")
	c.Flags().BoolVarP(&f.tty, "tty", "t", false, "run on a terminal (raw mode here, resized with this one)")
}

func newExecCmd(g *globals) *cobra.Command {
	var sf sessionFlags
	var env []string
	var cwd, user string
	var timeout time.Duration
	var detach bool
	c := &cobra.Command{
		Use:   "exec [-i] [-t] NAME -- CMD [ARG...]",
		Short: "Run a command in a VM; streams its output and exits with its exit code",
		Args:  cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if cmd.ArgsLenAtDash() != 1 {
				return errors.New("usage: carrel exec [flags] NAME -- CMD [ARG...]")
			}
			req := &agentv1.ExecRequest{Argv: args[1:], Env: env, Cwd: cwd, User: user, Tty: sf.tty, Detach: detach,
				// Without -i the command reads an empty stdin, as with
				// docker exec; a detached one keeps stdin for carrel attach -i.
				NoStdin: !sf.interactive && !sf.tty && !detach}
			ctx := cmd.Context()
			if timeout > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, timeout)
				defer cancel()
			}
			if detach {
				_, err := g.client().Run(ctx, client.Session{VM: args[0], Start: req, DetachAfterStart: true,
					Started: func(id string, _ int32) { fmt.Println(id) }})
				if errors.Is(err, client.ErrDetached) {
					return nil
				}
				return carrelFailed(err)
			}
			return runSession(ctx, g, sf, client.Session{VM: args[0], Start: req})
		},
	}
	sf.add(c)
	c.Flags().StringArrayVarP(&env, "env", "e", nil, "set KEY=VALUE in the command's environment (repeatable)")
	c.Flags().StringVarP(&cwd, "cwd", "w", "", "working directory in the guest (default /workspace)")
	c.Flags().StringVarP(&user, "user", "u", "", "user name or uid in the guest (default agent, uid 1000)")
	c.Flags().DurationVar(&timeout, "timeout", 0, "kill the command after this long")
	c.Flags().BoolVarP(&detach, "detach", "d", false, "start the command, print its id and return; see carrel attach")
	return c
}

// runSession runs s on this terminal and exits with the command's status.
func runSession(ctx context.Context, g *globals, sf sessionFlags, s client.Session) error {
	s.Stdout, s.Stderr = os.Stdout, os.Stderr
	if sf.interactive {
		s.Stdin = os.Stdin
	}
	stdinTerm := term.IsTerminal(int(os.Stdin.Fd()))
	if sf.tty && stdinTerm {
		old, err := term.MakeRaw(int(os.Stdin.Fd()))
		if err != nil {
			return carrelFailed(err)
		}
		defer term.Restore(int(os.Stdin.Fd()), old)
		resize := make(chan *agentv1.Resize, 1)
		s.Resize = resize
		sendSize := func() {
			if w, h, err := term.GetSize(int(os.Stdin.Fd())); err == nil {
				select {
				case resize <- &agentv1.Resize{Rows: uint32(h), Cols: uint32(w)}:
				default:
				}
			}
		}
		if s.Start != nil {
			if w, h, err := term.GetSize(int(os.Stdin.Fd())); err == nil {
				s.Start.Rows, s.Start.Cols = uint32(h), uint32(w)
			}
		} else {
			sendSize()
		}
		winch := make(chan os.Signal, 1)
		signal.Notify(winch, syscall.SIGWINCH)
		defer signal.Stop(winch)
		go func() {
			for range winch {
				sendSize()
			}
		}()
	} else {
		// Without a terminal, ^C and friends are meant for the command.
		sigs := make(chan os.Signal, 4)
		signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT)
		defer signal.Stop(sigs)
		fwd := make(chan int32, 4)
		s.Signals = fwd
		go func() {
			for sig := range sigs {
				fwd <- int32(sig.(syscall.Signal))
			}
		}()
	}
	status, err := g.client().Run(ctx, s)
	if err != nil {
		return carrelFailed(err)
	}
	if status.Code != 0 {
		return exitError{int(status.Code)}
	}
	return nil
}

// carrelFailed prints carrel's own error and exits 125.
func carrelFailed(err error) error {
	if err == nil {
		return nil
	}
	fmt.Fprintln(os.Stderr, "carrel:", describe(err))
	return exitError{exitCarrelError}
}
