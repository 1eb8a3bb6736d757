package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/audit/review"
)

func newAuditShowCmd() *cobra.Command {
	var dir, output string
	var kinds []string
	var packages bool
	c := &cobra.Command{
		Use:   "show SESSION|VM [--kind K[,K...]] | show SESSION --packages",
		Short: "Print a session's (or a VM's) records as a timeline, one line each",
		Long: "SESSION (ses_...) shows that session's records, and those of its VM that name no session,\n" +
			"written while it ran; VM shows every record that names the VM, with its session. Each line\n" +
			"has the time (UTC), seq, kind, provenance (guest: what the agent in the VM reported) and a\n" +
			"summary. --kind keeps some kinds (exec.* keeps every kind starting exec.). --output json\n" +
			"prints each record as it is in records.log, one JSON object a line.\n" +
			"--packages prints instead the packages of the image the session ran on (name, version,\n" +
			"arch), from the image manifest its starting record keeps; --output json prints the image.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return err
			}
			if packages {
				if len(kinds) > 0 {
					return errors.New("--packages lists the image's packages: --kind does not apply")
				}
				return showPackages(cmd, dir, args[0], output)
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
			noteArchived(cmd.ErrOrStderr(), r)
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
	c.Flags().BoolVar(&packages, "packages", false, "print the packages of the image the session ran on, from its manifest in the log")
	addOutputFlag(c, &output)
	return c
}

// showPackages is `carrel audit show SESSION --packages`.
func showPackages(cmd *cobra.Command, dir, id, output string) error {
	if !review.IsSessionID(id) {
		return fmt.Errorf("--packages lists the packages of a session's image: %q is not a session (ses_ and 16 hex digits)", id)
	}
	r, s, err := openAuditSession(dir, id, cmd.ErrOrStderr())
	if err != nil {
		return err
	}
	defer r.Close()
	img := review.LoadImage(r, s)
	if img == nil {
		return fmt.Errorf("session %s: no vm.lifecycle record of it names its image", id)
	}
	if output == "json" {
		enc := json.NewEncoder(cmd.OutOrStdout())
		enc.SetIndent("", "  ")
		if err := enc.Encode(img); err != nil {
			return err
		}
	}
	if !img.ManifestRead {
		return fmt.Errorf("session %s: %s", id, strings.Join(img.Problems, "; "))
	}
	for _, p := range img.Problems {
		fmt.Fprintln(cmd.ErrOrStderr(), "note: "+p)
	}
	if output == "json" {
		return nil
	}
	return printPackages(cmd.OutOrStdout(), img)
}

// printPackages writes an image's packages as a table: name, version,
// arch ("-" for none).
func printPackages(w io.Writer, img *review.Image) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tVERSION\tARCH")
	for _, p := range img.Packages {
		arch := p.Arch
		if arch == "" {
			arch = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\n", p.Name, p.Version, arch)
	}
	return tw.Flush()
}
