package main

import (
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/supervisor/atomicfile"
	"github.com/carrel-os/carrel/supervisor/audit/review"
)

func newAuditReportCmd() *cobra.Command {
	var dir, out, key string
	var maxOutput int64
	c := &cobra.Command{
		Use:   "report SESSION -o report.html [--key KEY]",
		Short: "Write one self-contained HTML page about a session: integrity, decisions, commands, files, timeline, terminal player",
		Long: "The page loads nothing from anywhere (it embeds the asciinema player and the session's cast), so\n" +
			"it can be archived or mailed as it is. It says whether the session's records are in the log's\n" +
			"signed tree (checked with --key, or the log's key.pub) and its blobs intact, lists every policy\n" +
			"decision, every command with its output (each stream cut at --max-output bytes in the text; the\n" +
			"player has up to 16 MiB), the files touched and the whole timeline.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if out == "" {
				return errors.New("-o FILE is required: where to write the page (- for stdout)")
			}
			r, s, err := openAuditSession(dir, args[0], cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			defer r.Close()
			opts := review.ReportOptions{Key: strings.TrimSpace(key), MaxOutput: maxOutput}
			if out == "-" {
				return review.WriteReport(cmd.OutOrStdout(), r, s, opts)
			}
			if err := atomicfile.Write(out, 0o644, func(w io.Writer) error { return review.WriteReport(w, r, s, opts) }); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "wrote %s: session %s of vm %s, %d records, %d commands\n", out, s.ID, review.SafeText(s.VM), len(s.Entries), len(s.Commands()))
			return nil
		},
	}
	c.Flags().StringVar(&dir, "dir", defaultAuditDir, "the audit log's directory (carreld's state dir + /audit, or a copy)")
	c.Flags().StringVarP(&out, "output-file", "o", "", "where to write the page (- for stdout)")
	c.Flags().StringVar(&key, "key", "", "the verifier key the checkpoint must be signed with (from carrel audit key)")
	c.Flags().Int64Var(&maxOutput, "max-output", 64<<10, "show at most this many bytes of each command's stdout and of its stderr as text")
	return c
}
