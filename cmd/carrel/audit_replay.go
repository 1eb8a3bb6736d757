package main

import (
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/carrel-os/carrel/supervisor/atomicfile"
	"github.com/carrel-os/carrel/supervisor/audit/review"
)

func newAuditReplayCmd() *cobra.Command {
	var dir, cast string
	var speed float64
	var maxIdle time.Duration
	var raw bool
	c := &cobra.Command{
		Use:   "replay SESSION [--speed N] [--max-idle DURATION] [--cast FILE]",
		Short: "Play a session's terminal output back, in real time or faster, or write it as an asciinema cast",
		Long: "Plays every command's stdout and stderr in the order and at the pace they were recorded,\n" +
			"each after a \"$ command\" line. --speed 10 plays ten times faster; --max-idle caps each pause\n" +
			"(0: keep them all). The output is a guest's: escape sequences that reach beyond the screen\n" +
			"(titles, the clipboard, terminal queries) are dropped unless --raw.\n" +
			"--cast FILE writes an asciicast v2 file instead (asciinema play FILE, or any asciinema player),\n" +
			"with the recorded times (--max-idle goes in its header); - writes it to stdout.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if speed <= 0 {
				return fmt.Errorf("--speed must be more than 0, not %v", speed)
			}
			if maxIdle < 0 {
				return fmt.Errorf("--max-idle must not be negative")
			}
			r, s, err := openAuditSession(dir, args[0], cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			defer r.Close()
			cmds := s.Commands()
			if cast != "" {
				opts := review.CastOptions{Title: "carrel session " + s.ID + " (vm " + s.VM + ")", IdleTimeLimit: maxIdle}
				if cast == "-" {
					_, err := review.WriteCast(cmd.OutOrStdout(), r.Dir(), s, cmds, opts)
					return err
				}
				var st review.CastStats
				if err := atomicfile.Write(cast, 0o644, func(w io.Writer) error {
					st, err = review.WriteCast(w, r.Dir(), s, cmds, opts)
					return err
				}); err != nil {
					return err
				}
				fmt.Fprintf(cmd.ErrOrStderr(), "wrote %s: %d commands, %d bytes of output, %s long\n", cast, len(cmds), st.Bytes, st.Duration.Round(time.Millisecond))
				if st.Omitted > 0 {
					fmt.Fprintf(cmd.ErrOrStderr(), "note: %d bytes of output past the cap of %d are left out; the cast says so at its end\n", st.Omitted, review.DefaultCastMax)
				}
				return nil
			}
			if len(cmds) == 0 {
				fmt.Fprintf(cmd.ErrOrStderr(), "session %s ran no commands\n", s.ID)
				return nil
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			tty := term.IsTerminal(int(os.Stdout.Fd()))
			err = review.Replay(ctx, cmd.OutOrStdout(), r.Dir(), cmds, review.ReplayOptions{Speed: speed, MaxIdle: maxIdle, Raw: raw, Color: tty})
			if tty && !raw {
				fmt.Fprint(cmd.OutOrStdout(), "\x1b[0m") // whatever colour the guest left on
			}
			if ctx.Err() != nil {
				return exitError{code: 130}
			}
			return err
		},
	}
	c.Flags().StringVar(&dir, "dir", defaultAuditDir, "the audit log's directory (carreld's state dir + /audit, or a copy)")
	c.Flags().Float64Var(&speed, "speed", 1, "play this many times faster")
	c.Flags().DurationVar(&maxIdle, "max-idle", 2*time.Second, "cap each pause at this (0: no cap)")
	c.Flags().StringVar(&cast, "cast", "", "write an asciicast v2 file here instead of playing (- for stdout)")
	c.Flags().BoolVar(&raw, "raw", false, "pass every escape sequence the guest wrote to this terminal")
	return c
}
