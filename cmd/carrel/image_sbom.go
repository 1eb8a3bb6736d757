package main

import (
	"errors"
	"fmt"
	"io"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/image/sbom"
	"github.com/carrel-os/carrel/supervisor/atomicfile"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

// sbomFormats are the formats carrel image sbom writes, by --format name.
var sbomFormats = map[string]func(*manifest.Manifest, string, time.Time) ([]byte, error){
	"spdx":      sbom.SPDX,
	"cyclonedx": sbom.CycloneDX,
}

func newImageSBOMCmd(g *globals) *cobra.Command {
	var format, out string
	c := &cobra.Command{
		Use:   "sbom REF [--format spdx|cyclonedx] [-o FILE]",
		Short: "Export a stored image's software bill of materials as SPDX 2.3 or CycloneDX 1.5 JSON",
		Long: "Write the package list of the image's manifest as an SBOM: SPDX 2.3 JSON (the default) or CycloneDX 1.5\n" +
			"JSON. The image is named by its manifest digest, and the creation time is when the store first held it,\n" +
			"so exporting the same stored image again gives the same bytes.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			write, ok := sbomFormats[format]
			if !ok {
				return fmt.Errorf("--format must be spdx or cyclonedx, not %q", format)
			}
			resp, err := g.client().Images.InspectImage(cmd.Context(), connect.NewRequest(&apiv1.InspectImageRequest{Ref: args[0]}))
			if err != nil {
				return err
			}
			b, err := renderSBOM(write, resp.Msg.Image, []byte(resp.Msg.ManifestJson))
			if err != nil {
				return err
			}
			if out == "" || out == "-" {
				_, err = cmd.OutOrStdout().Write(b)
				return err
			}
			return atomicfile.Write(out, 0o644, func(w io.Writer) error {
				_, err := w.Write(b)
				return err
			})
		},
	}
	c.Flags().StringVar(&format, "format", "spdx", "SBOM format: spdx (SPDX 2.3 JSON) or cyclonedx (CycloneDX 1.5 JSON)")
	c.Flags().StringVarP(&out, "output-file", "o", "", "write the SBOM to this file (atomically; - or empty: standard output)")
	return c
}

// renderSBOM writes the SBOM of img, whose manifest carreld sent as raw,
// after checking that raw is the manifest img's digest names.
func renderSBOM(write func(*manifest.Manifest, string, time.Time) ([]byte, error), img *apiv1.Image, raw []byte) ([]byte, error) {
	if img == nil {
		return nil, errors.New("carreld sent no image")
	}
	if got := manifest.DigestBytes(raw); got != img.Digest {
		return nil, fmt.Errorf("image %s: carreld sent a manifest whose digest is %s", img.Digest, got)
	}
	m, err := manifest.Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", img.Digest, err)
	}
	created, err := time.Parse(time.RFC3339, img.CreatedAt)
	if err != nil {
		return nil, fmt.Errorf("image %s: creation time %q: %w", img.Digest, img.CreatedAt, err)
	}
	return write(m, img.Digest, created)
}
