package main

import (
	"bufio"
	"fmt"

	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/audit/review"
)

func newAuditShowCmd() *cobra.Command {
	var dir, output string
	var kinds []string
	c := &cobra.Command{
		Use:   "show SESSION|VM [--kind K[,K...]]",
		Short: "Print a session's (or a VM's) records as a timeline, one line each",
		Long: "SESSION (ses_...) shows that session's records, and those of its VM that name no session,\n" +
			"written while it ran; VM shows every record that names the VM, with its session. Each line\n" +
			"has the time (UTC), seq, kind, provenance (guest: what the agent in the VM reported) and a\n" +
			"summary. --kind keeps some kinds (exec.* keeps every kind starting exec.). --output json\n" +
			"prints each record as it is in records.log, one JSON object a line.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return err
			}
			filter, err := review.ParseKinds(kinds)
			if err != nil {
				return err
			}
			w := bufio.NewWriter(cmd.OutOrStdout())
			defer w.Flush()
			print := func(e *review.Entry, withSession bool) {
				if !filter.Match(e.Kind) {
					return
				}
				if output == "json" {
					w.Write(e.Payload)
					w.WriteByte('\n')
				} else {
					fmt.Fprintln(w, review.TimelineLine(e, withSession))
				}
			}
			if review.IsSessionID(args[0]) {
				r, s, err := openAuditSession(dir, args[0], cmd.ErrOrStderr())
				if err != nil {
					return err
				}
				defer r.Close()
				if output != "json" {
					fmt.Fprintln(w, review.TimelineHeader(false))
				}
				for i := range s.Entries {
					print(&s.Entries[i], false)
				}
				return w.Flush()
			}
			r, err := audit.OpenReader(dir)
			if err != nil {
				return err
			}
			defer r.Close()
			if output != "json" {
				fmt.Fprintln(w, review.TimelineHeader(true))
			}
			end, err := review.ScanVM(r, args[0], func(e review.Entry) error {
				print(&e, true)
				return nil
			})
			if err != nil {
				return err
			}
			noteTail(cmd.ErrOrStderr(), end)
			return w.Flush()
		},
	}
	c.Flags().StringVar(&dir, "dir", defaultAuditDir, "the audit log's directory (carreld's state dir + /audit, or a copy)")
	c.Flags().StringSliceVar(&kinds, "kind", nil, "only records of these kinds (comma-separated, repeatable; exec.* for all exec kinds)")
	addOutputFlag(c, &output)
	return c
}
