package main

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/audit/rerun"
	"github.com/carrel-os/carrel/supervisor/audit/review"
)

func newAuditRerunCmd(g *globals) *cobra.Command {
	var dir, name string
	var keep bool
	c := &cobra.Command{
		Use:   "rerun SESSION",
		Short: "Replay a session's commands and file writes on a fresh VM and report where the outputs differ",
		Long: "Reads the session from the audit log (--dir), creates a fresh VM from the image digest and\n" +
			"the policy the session ran under (its revision must match), runs the recorded commands with\n" +
			"their recorded stdin and writes the recorded files, in order, and compares exit statuses,\n" +
			"stdout and stderr with the record. The VM is deleted afterwards unless --keep. Exits 1 when\n" +
			"anything differs. Needs a running carreld with the image in its store.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if !review.IsSessionID(args[0]) {
				return fmt.Errorf("%q is not a session id (ses_…): see carrel vm ls or carrel audit show VM", args[0])
			}
			r, err := audit.OpenReader(dir)
			if err != nil {
				return err
			}
			defer r.Close()
			s, err := review.LoadSession(r, args[0])
			if err != nil {
				return err
			}
			plan, err := rerun.Build(s)
			if err != nil {
				return err
			}
			if name == "" {
				var b [3]byte
				rand.Read(b[:])
				name = "rerun-" + hex.EncodeToString(b[:])
			}
			out := cmd.OutOrStdout()
			fmt.Fprintf(out, "rerun of %s (vm %s): %d steps on a fresh vm %s, image %s, policy %s %s\n",
				plan.Session, plan.VM, len(plan.Steps), name, short(plan.ImageDigest), plan.Policy, short(plan.PolicyRevision))
			for _, s := range plan.Skipped {
				fmt.Fprintf(out, "  skipped: %s\n", s)
			}
			differ := 0
			_, err = rerun.Run(cmd.Context(), g.client(), dir, plan, rerun.Options{VM: name, Keep: keep, Progress: func(res rerun.Result) {
				what := stepText(res.Step)
				switch {
				case res.Err != nil:
					differ++
					fmt.Fprintf(out, "  FAILED  %s: %v\n", what, res.Err)
				case !res.Same:
					differ++
					fmt.Fprintf(out, "  DIFFERS %s\n", what)
					for _, d := range res.Diffs {
						fmt.Fprintf(out, "          %s\n", d)
					}
				default:
					fmt.Fprintf(out, "  same    %s\n", what)
				}
			}})
			if err != nil {
				return err
			}
			if differ > 0 {
				fmt.Fprintf(out, "%d of %d steps differ from the record\n", differ, len(plan.Steps))
				return exitError{code: 1}
			}
			fmt.Fprintf(out, "ok: all %d steps match the record\n", len(plan.Steps))
			return nil
		},
	}
	c.Flags().StringVar(&dir, "dir", defaultAuditDir, "the audit log's directory (carreld's state dir + /audit)")
	c.Flags().StringVar(&name, "vm", "", "name of the fresh VM (default rerun-<random>)")
	c.Flags().BoolVar(&keep, "keep", false, "leave the VM running afterwards")
	return c
}

// stepText is one line naming a step, safe to print.
func stepText(s rerun.Step) string {
	switch s.Kind {
	case "write":
		return fmt.Sprintf("#%d write %s", s.Seq, printable(s.Path))
	case "file":
		to := ""
		if s.To != "" {
			to = " -> " + printable(s.To)
		}
		return fmt.Sprintf("#%d %s %s%s", s.Seq, strings.TrimPrefix(s.Action, "file."), printable(s.Path), to)
	}
	return fmt.Sprintf("#%d exec %s", s.Seq, printable(strings.Join(s.Argv, " ")))
}

// printable replaces control characters, so recorded text cannot drive
// the reviewer's terminal.
func printable(s string) string {
	return strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) {
			return '?'
		}
		return r
	}, s)
}
