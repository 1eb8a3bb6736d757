package main

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/supervisor/audit"
)

func newAuditArchiveCmd() *cobra.Command {
	var dir, to, output string
	var before time.Duration
	var keep int
	c := &cobra.Command{
		Use:   "archive --to DIR [--before DURATION | --keep N]",
		Short: "Move the audit log's oldest rotated segments to another directory, leaving a manifest for each",
		Long: "carreld rolls records.log over into segments/ by size and age (--audit-segment-size,\n" +
			"--audit-segment-age). This moves the oldest rotated segments, never records.log, to DIR:\n" +
			"each is copied, synced, read back and compared by sha256, then a manifest\n" +
			"segments/NAME.archived (its records, bytes, sha256, where it went and the signed checkpoint\n" +
			"at its end) is written in its place, and only then is the segment removed. --before keeps\n" +
			"segments written within DURATION, --keep the newest N. It may run while carreld runs.\n" +
			"carrel audit verify then checks the log through the checkpoint at the archived segments' end\n" +
			"and lists them; carrel audit verify --archive DIR reads them back for a full check.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return err
			}
			if to == "" {
				return fmt.Errorf("--to DIR is required: where the segments go")
			}
			opts := audit.ArchiveOptions{Keep: keep}
			if before > 0 {
				opts.Before = time.Now().Add(-before)
			}
			moved, err := audit.Archive(dir, to, opts)
			if output == "json" {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				if moved == nil {
					moved = []audit.ArchivedSegment{}
				}
				if eerr := enc.Encode(moved); eerr != nil {
					return eerr
				}
			} else {
				for _, m := range moved {
					fmt.Fprintf(cmd.OutOrStdout(), "archived %s: records %d-%d, %d bytes, sha256 %s\n", m.Name, m.FirstSeq, m.LastSeq, m.Bytes, m.SHA256)
				}
				if err == nil && len(moved) == 0 {
					fmt.Fprintln(cmd.OutOrStdout(), "no rotated segment to archive")
				}
			}
			return err
		},
	}
	c.Flags().StringVar(&dir, "dir", defaultAuditDir, "the audit log's directory (carreld's state dir + /audit)")
	c.Flags().StringVar(&to, "to", "", "the directory to move the segments to (another disk or host mount)")
	c.Flags().DurationVar(&before, "before", 0, "archive only segments last written longer ago than this, e.g. 720h")
	c.Flags().IntVar(&keep, "keep", 0, "keep the newest N rotated segments in place")
	addOutputFlag(c, &output)
	return c
}
