package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"unicode"

	"github.com/spf13/cobra"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/supervisor/client"
)

func newWatchCmd(g *globals) *cobra.Command {
	var output string
	var recursive bool
	var rate uint32
	c := &cobra.Command{
		Use:   "watch NAME PATH",
		Short: "Print changes below a directory in a VM, one event per line, until interrupted",
		Long: `Print changes below a directory in a VM, one event per line, until interrupted
or until the directory itself goes away.

Each line is "OP PATH", where OP is CREATE, MODIFY, DELETE or RENAME; a
rename reads "RENAME OLD -> NEW". Directories end in "/". Paths holding
control characters are printed quoted. With --output json, each line is
one WatchEvent as JSON.

Notes go to stderr, starting with "#": "# watching PATH" once the watch is
in place, "# dropped N events" when events were over the rate or lost, and
"# N directories not watched" when the cap on directories was reached.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if output != "text" && output != "json" {
				return fmt.Errorf("--output must be text or json, not %q", output)
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			out := bufio.NewWriter(cmd.OutOrStdout())
			notes := cmd.ErrOrStderr()
			first := true
			opts := client.WatchOptions{Recursive: recursive, MaxEventsPerSecond: rate}
			err := g.client().Watch(ctx, args[0], args[1], opts, func(m *agentv1.WatchResponse) error {
				if first {
					first = false
					fmt.Fprintf(notes, "# watching %s\n", args[1])
				}
				if m.Dropped > 0 {
					fmt.Fprintf(notes, "# dropped %d events\n", m.Dropped)
				}
				if m.UnwatchedDirs > 0 {
					fmt.Fprintf(notes, "# %d directories not watched: the watch's cap on directories was reached\n", m.UnwatchedDirs)
				}
				for _, e := range m.Events {
					if err := printWatchEvent(out, e, output == "json"); err != nil {
						return err
					}
				}
				return out.Flush()
			})
			if errors.Is(err, context.Canceled) && ctx.Err() != nil {
				return nil // interrupted
			}
			return err
		},
	}
	c.Flags().StringVarP(&output, "output", "o", "text", "output format: text or json (one object a line)")
	c.Flags().BoolVarP(&recursive, "recursive", "r", true, "watch subdirectories too, including new ones")
	c.Flags().Uint32Var(&rate, "max-rate", 0, "most events a second; the rest are counted as dropped (0: carreld's default, 1000)")
	return c
}

var watchOpNames = map[agentv1.WatchOp]string{
	agentv1.WatchOp_WATCH_OP_CREATE: "CREATE",
	agentv1.WatchOp_WATCH_OP_MODIFY: "MODIFY",
	agentv1.WatchOp_WATCH_OP_DELETE: "DELETE",
	agentv1.WatchOp_WATCH_OP_RENAME: "RENAME",
}

// printWatchEvent writes e as one line.
func printWatchEvent(w io.Writer, e *agentv1.WatchEvent, asJSON bool) error {
	if asJSON {
		b, err := protojson.MarshalOptions{EmitUnpopulated: true}.Marshal(e)
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(w, "%s\n", b)
		return err
	}
	op := watchOpNames[e.Op]
	if op == "" {
		op = e.Op.String()
	}
	p := watchPath(e.Path, e.IsDir)
	if e.Op == agentv1.WatchOp_WATCH_OP_RENAME {
		p = watchPath(e.OldPath, e.IsDir) + " -> " + p
	}
	_, err := fmt.Fprintf(w, "%s %s\n", op, p)
	return err
}

// watchPath shows a guest path on one line: quoted if it holds control
// characters, with "/" after a directory.
func watchPath(p string, dir bool) string {
	if dir && p != "/" {
		p += "/"
	}
	if strings.ContainsFunc(p, unicode.IsControl) {
		return strconv.Quote(p)
	}
	return p
}
