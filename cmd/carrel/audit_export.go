package main

import (
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/supervisor/atomicfile"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/audit/review"
)

func newAuditExportCmd() *cobra.Command {
	var dir, out, key string
	c := &cobra.Command{
		Use:   "export SESSION -o bundle.tar [--key KEY]",
		Short: "Write a session's evidence bundle: its records with inclusion proofs, blobs, the signed checkpoint and the key",
		Long: "The bundle (a tar file) holds the session's records byte for byte, each with an RFC 6962\n" +
			"inclusion proof against the log's latest signed checkpoint, the blobs they reference, that\n" +
			"checkpoint (with the witnesses' cosignatures), the log's verifier key and a manifest (session,\n" +
			"VM, image digest, policy and revision), signed by the log's key when it can be read here. Records after the checkpoint are left out (the manifest counts them); carreld signs\n" +
			"one every 5 seconds while records arrive. Check a bundle anywhere with\n" +
			"carrel audit verify --bundle FILE --key KEY. --key makes the export hold the checkpoint to the\n" +
			"key you kept, instead of the log's key.pub.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if out == "" {
				return errors.New("-o FILE is required: where to write the bundle")
			}
			r, s, err := openAuditSession(dir, args[0], cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			defer r.Close()
			// The manifest is signed with the log's key when this user can
			// read it (root, on the log's host); a copy elsewhere exports
			// an unsigned one, and says so.
			signer, serr := audit.Signer(dir)
			if serr != nil {
				fmt.Fprintf(cmd.ErrOrStderr(), "note: the manifest is not signed: %v\n", serr)
			}
			var m *review.Manifest
			if err := atomicfile.Write(out, 0o644, func(w io.Writer) error {
				m, err = review.Export(w, r, s, review.ExportOptions{Key: strings.TrimSpace(key), Signer: signer})
				return err
			}); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "wrote %s: session %s of vm %s, %d records, %d blobs, proved against the checkpoint of %d records\n",
				out, m.Session, review.SafeText(m.VM), m.Records, len(m.Blobs), m.TreeSize)
			if m.Unsigned > 0 {
				fmt.Fprintf(cmd.OutOrStdout(), "note: the session's last %d records follow that checkpoint and are not in the bundle; export again once carreld signs the next\n", m.Unsigned)
			}
			if key == "" {
				fmt.Fprintln(cmd.OutOrStdout(), "note: the checkpoint was checked with the log's own key.pub; whoever checks the bundle should pass --key with a key kept apart from the log")
			}
			return nil
		},
	}
	c.Flags().StringVar(&dir, "dir", defaultAuditDir, "the audit log's directory (carreld's state dir + /audit, or a copy)")
	c.Flags().StringVarP(&out, "output-file", "o", "", "where to write the bundle (a tar file)")
	c.Flags().StringVar(&key, "key", "", "the verifier key the checkpoint must be signed with (from carrel audit key)")
	return c
}
