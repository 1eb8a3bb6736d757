package main

import (
	"encoding/json"

	"fmt"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/mod/sumdb/note"

	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/audit/review"
	"github.com/carrel-os/carrel/supervisor/witness"
)

// defaultAuditDir is the audit log of a carreld with the default state
// directory. Review works on the files (a copy will do), not through
// carreld, so that a reviewer needs neither carreld nor its trust.
const defaultAuditDir = "/var/lib/carrel/audit"

func newAuditCmd(g *globals) *cobra.Command {
	c := &cobra.Command{Use: "audit", Short: "Review the tamper-evident audit log: verify, show, replay, export, report (offline, on its files), and rerun a session"}
	c.AddCommand(newAuditKeyCmd(), newAuditVerifyCmd(), newAuditRecoverCmd(), newAuditArchiveCmd(), newAuditShowCmd(), newAuditReplayCmd(), newAuditExportCmd(), newAuditReportCmd(), newAuditRerunCmd(g))
	return c
}

func newAuditKeyCmd() *cobra.Command {
	var dir string
	c := &cobra.Command{
		Use:   "key",
		Short: "Print the public key the log's checkpoints are signed with; keep it apart from the log",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			k, err := audit.PublicKey(dir)
			if err != nil {
				return err
			}
			fmt.Println(k)
			return nil
		},
	}
	c.Flags().StringVar(&dir, "dir", defaultAuditDir, "the audit log's directory (carreld's state dir + /audit)")
	return c
}

func newAuditVerifyCmd() *cobra.Command {
	var dir, key, output, bundle, archive string
	var checkpoints, witnesses []string
	var quorum int
	var packages bool
	c := &cobra.Command{
		Use:   "verify [--key KEY] [--checkpoint FILE]... [--witness KEY... [--quorum N]] [--archive DIR] | verify --bundle FILE [--key KEY] [--packages]",
		Short: "Recompute the Merkle tree, check every checkpoint's signature and root, and every blob",
		Long: "Reports every flipped, dropped, reordered or truncated record, replaced blob and forged\n" +
			"checkpoint, with its position. Exits 1 when there is any. Without --key the log's own\n" +
			"key.pub is used, which proves less: pass the key you kept (carrel audit key).\n" +
			"--checkpoint holds the log to a checkpoint you kept from earlier, so a log cut back\n" +
			"below it is caught even if its own checkpoints were cut too.\n" +
			"--witness requires the checkpoints to carry that witness's cosignatures: every one of them\n" +
			"must verify, and the newest checkpoint must have --quorum of them (default 1); this catches a\n" +
			"log its own host rewrote and signed again with its own key. It lists the checkpoints that\n" +
			"lack cosignatures.\n" +
			"Segments moved away by carrel audit archive are listed, and checked through the signed checkpoint\n" +
			"at their end; --archive DIR reads them from DIR (each must match its manifest's sha256) so the\n" +
			"check covers them too. Records in no segment and no manifest are a problem.\n" +
			"--bundle checks an evidence bundle (carrel audit export) instead of a log: the checkpoint's\n" +
			"signature, each record's inclusion proof, each blob, and the manifest; it names the image the\n" +
			"session ran on, and --packages lists the packages of the image manifest the bundle holds. With\n" +
			"--witness, the bundle's checkpoint must carry --quorum valid cosignatures of those witnesses,\n" +
			"and every one of theirs on it must be of that checkpoint.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return err
			}
			var ws []note.Verifier
			for _, k := range witnesses {
				v, err := witness.NewVerifier(k)
				if err != nil {
					return fmt.Errorf("--witness: %w", err)
				}
				ws = append(ws, v)
			}
			if quorum > len(witnesses) {
				return fmt.Errorf("--quorum %d: only %d witnesses given", quorum, len(witnesses))
			}
			if bundle != "" {
				if len(checkpoints) > 0 || cmd.Flags().Changed("dir") {
					return fmt.Errorf("--bundle checks a bundle, not a log: --dir and --checkpoint do not apply")
				}
				return verifyBundle(cmd, bundle, review.BundleVerifyOptions{Key: strings.TrimSpace(key), Witnesses: ws, Quorum: quorum}, output, packages)
			}
			if packages {
				return fmt.Errorf("--packages lists the image's packages from a bundle: it needs --bundle (or use carrel audit show SESSION --packages)")
			}
			opts := audit.VerifyOptions{Key: strings.TrimSpace(key), Quorum: quorum, Witnesses: ws, Archive: archive}
			for _, f := range checkpoints {
				b, err := os.ReadFile(f)
				if err != nil {
					return err
				}
				opts.Checkpoints = append(opts.Checkpoints, b)
			}
			rep, err := audit.Verify(dir, opts)
			if err != nil {
				return err
			}
			if output == "json" {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				if err := enc.Encode(rep); err != nil {
					return err
				}
			} else {
				fmt.Printf("%d records (%d bytes) in %d segments, %d checkpoints (latest verified: %d records), %d blobs\n",
					rep.Records, rep.Bytes, rep.Segments, rep.Checkpoints, rep.Latest, rep.Blobs)
				if rep.From > 0 {
					fmt.Printf("records 0-%d are in %d archived segments, not read: checked through the signed checkpoint at %d\n", rep.From-1, len(rep.Archived), rep.From)
					for _, a := range rep.Archived {
						fmt.Printf("archived %s: records %d-%d, %d bytes, sha256 %s, to %s at %s\n", a.Name, a.FirstSeq, a.LastSeq, a.Bytes, a.SHA256, a.ArchivedTo, a.ArchivedAt.UTC().Format(time.RFC3339))
					}
				}
				if rep.KeyFromLog {
					fmt.Println("note: checked against the log's own key.pub; pass --key with the key you kept")
				}
				for _, sl := range rep.Sealed {
					fmt.Printf("sealed log %s: %d records (last good checkpoint: %d records), unreadable: %s\n", sl.Dir, sl.Records, sl.Latest, sizesText(sl.Unreadable))
				}
				if len(opts.Witnesses) > 0 {
					fmt.Printf("witnessed up to %d records", rep.Witnessed)
					if len(rep.Unwitnessed) > 0 {
						fmt.Printf("; checkpoints without %d cosignatures: %s", max(quorum, 1), sizesText(rep.Unwitnessed))
					}
					fmt.Println()
				}
				for _, p := range rep.Problems {
					fmt.Println(describeProblem(p))
				}
				if rep.Omitted > 0 {
					fmt.Printf("... and %d more problems\n", rep.Omitted)
				}
			}
			if len(rep.Problems) > 0 || rep.Omitted > 0 {
				if output != "json" {
					fmt.Fprintf(os.Stderr, "carrel: the audit log FAILED verification: %d problems\n", len(rep.Problems)+rep.Omitted)
				}
				return exitError{code: 1}
			}
			if output != "json" {
				fmt.Println("ok: the log is intact")
			}
			return nil
		},
	}
	c.Flags().StringVar(&dir, "dir", defaultAuditDir, "the audit log's directory (carreld's state dir + /audit, or a copy)")
	c.Flags().StringVar(&key, "key", "", "the verifier key to hold checkpoints to (from carrel audit key)")
	c.Flags().StringArrayVar(&checkpoints, "checkpoint", nil, "a signed checkpoint kept from earlier (repeatable)")
	c.Flags().StringArrayVar(&witnesses, "witness", nil, "a witness's cosignature/v1 key whose cosignatures the checkpoints must carry (repeatable)")
	c.Flags().IntVar(&quorum, "quorum", 0, "with --witness: how many witnesses' valid cosignatures the newest checkpoint (or the bundle's) needs (default 1)")
	c.Flags().StringVar(&bundle, "bundle", "", "check this evidence bundle (from carrel audit export) instead of a log")
	c.Flags().BoolVar(&packages, "packages", false, "with --bundle: also list the packages of the session's image")
	c.Flags().StringVar(&archive, "archive", "", "read archived segments from this directory (where carrel audit archive --to put them)")
	addOutputFlag(c, &output)
	return c
}

func newAuditRecoverCmd() *cobra.Command {
	var dir string
	c := &cobra.Command{
		Use:   "recover [--dir DIR]",
		Short: "After damage that keeps carreld from starting: seal the damaged log as evidence and start a new one chained to it",
		Long: "Run with carreld stopped, when it refuses to start because the audit log is damaged in the middle\n" +
			"(\"audit log corrupt at offset ...\"). It verifies the log, moves its records, hashes and checkpoints\n" +
			"to sealed/TIME/ under the log's directory, read-only, and starts a new log whose first record (an\n" +
			"audit.recovery of cause corruption) names the sealed log, its unreadable records and its last good\n" +
			"checkpoint. Nothing is deleted. carrel audit verify then checks the sealed log too, and names its\n" +
			"unreadable records; carrel audit show --dir DIR/sealed/TIME reads it. A log that opens is refused.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := audit.RecoverCorrupt(dir, time.Now())
			if err != nil {
				return err
			}
			fmt.Printf("sealed the damaged log in %s: %d records, unreadable: %s; its last good checkpoint is at %d records\n",
				s.Dir, s.Report.Records, sizesText(s.Report.Unreadable()), s.Report.Latest)
			fmt.Println("started a new log chained to it: carreld can start")
			return nil
		},
	}
	c.Flags().StringVar(&dir, "dir", defaultAuditDir, "the audit log's directory (carreld's state dir + /audit)")
	return c
}

// sizesText lists checkpoint sizes, the first few.
func sizesText(sizes []uint64) string {
	var s []string
	for i, n := range sizes {
		if i == 10 {
			s = append(s, fmt.Sprintf("and %d more", len(sizes)-10))
			break
		}
		s = append(s, fmt.Sprint(n))
	}
	return strings.Join(s, ", ")
}

func describeProblem(p audit.Problem) string {
	var at []string
	if p.Seq != nil {
		at = append(at, fmt.Sprintf("record %d", *p.Seq))
	}
	if p.Offset != nil {
		at = append(at, fmt.Sprintf("byte %d", *p.Offset))
	}
	if p.Checkpoint != nil {
		at = append(at, fmt.Sprintf("checkpoint %d", *p.Checkpoint))
	}
	if p.Blob != "" {
		at = append(at, "blob "+p.Blob)
	}
	where := strings.Join(at, ", ")
	if where == "" {
		where = "log"
	}
	return fmt.Sprintf("%s at %s: %s", p.Kind, where, p.Detail)
}
