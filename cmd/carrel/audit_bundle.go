package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/supervisor/audit/review"
)

// verifyBundle is `carrel audit verify --bundle FILE`: it checks an
// evidence bundle that carrel audit export wrote, on any machine.
func verifyBundle(cmd *cobra.Command, path string, opts review.BundleVerifyOptions, output string, packages bool) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	rep, err := review.VerifyBundle(f, opts)
	if err != nil {
		return err
	}
	w := cmd.OutOrStdout()
	if output == "json" {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			return err
		}
	} else {
		if m := rep.Manifest; m != nil {
			fmt.Fprintf(w, "bundle of session %s of vm %s, made %s\n", review.SafeText(m.Session), review.SafeText(m.VM), m.Created.UTC().Format("2006-01-02T15:04:05Z"))
			policy := review.SafeText(m.Policy)
			if m.PolicyRevision != "" {
				policy += "@" + review.SafeText(m.PolicyRevision)
			}
			image := orNone(review.SafeText(m.ImageDigest))
			if img := rep.Image; img != nil {
				if img.Name != "" {
					image = img.Name + " " + image
				}
				if img.RootHash != "" {
					image += ", root hash " + img.RootHash
				}
			}
			fmt.Fprintf(w, "image %s, policy %s\n", image, orNone(policy))
		}
		if img := rep.Image; img != nil {
			if img.ManifestRead {
				fmt.Fprintf(w, "image manifest: kernel %s, %s, %d packages\n", img.KernelVersion, img.Arch, len(img.Packages))
			}
			for _, p := range img.Problems {
				fmt.Fprintln(w, "note: "+p)
			}
		}
		sig := "signature verified with the key given"
		switch {
		case !rep.CheckpointVerified:
			sig = "signature NOT verified"
		case rep.KeyFromBundle:
			sig = "signature verified with the bundle's own key.pub"
		}
		fmt.Fprintf(w, "%d records, %d blobs, checkpoint of %d records (%s)\n", rep.Records, rep.Blobs, rep.TreeSize, sig)
		if len(opts.Witnesses) > 0 {
			names := "none"
			if len(rep.Cosigned) > 0 {
				names = review.SafeText(strings.Join(rep.Cosigned, ", "))
			}
			fmt.Fprintf(w, "checkpoint cosigned by %d of the %d witnesses given (%d needed): %s\n", len(rep.Cosigned), len(opts.Witnesses), max(opts.Quorum, 1), names)
		}
		if rep.ManifestSigned {
			fmt.Fprintln(w, "manifest signed by the log's key")
		}
		for _, n := range rep.Notes {
			fmt.Fprintln(w, "note: "+n)
		}
		for _, p := range rep.Problems {
			fmt.Fprintln(w, describeProblem(p))
		}
		if rep.Omitted > 0 {
			fmt.Fprintf(w, "... and %d more problems\n", rep.Omitted)
		}
		if packages && rep.Image != nil && rep.Image.ManifestRead {
			if err := printPackages(w, rep.Image); err != nil {
				return err
			}
		}
	}
	if !rep.OK() {
		if output != "json" {
			fmt.Fprintf(cmd.ErrOrStderr(), "carrel: the bundle FAILED verification: %d problems\n", len(rep.Problems)+rep.Omitted)
		}
		return exitError{code: 1}
	}
	if output != "json" {
		witnessed := ""
		if len(opts.Witnesses) > 0 {
			witnessed = ", cosigned by a quorum of the witnesses"
		}
		fmt.Fprintf(w, "ok: every record is in the signed log at its seq%s, every blob is intact, and the manifest agrees\n", witnessed)
	}
	return nil
}

func orNone(s string) string {
	if s == "" {
		return "not recorded"
	}
	return s
}
