package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/image/debian"
	"github.com/carrel-os/carrel/image/imagedir"
	"github.com/carrel-os/carrel/image/manifest"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

func newImageCmd(g *globals) *cobra.Command {
	c := &cobra.Command{Use: "image", Short: "Build, import, check and list images"}
	c.AddCommand(newImageBuildCmd(g), newImageListCmd(g), newImageInspectCmd(g), newImageCheckCmd(), newImagePackCmd(), newImageImportCmd(g), newImageSBOMCmd(g))
	return c
}

func newImageBuildCmd(g *globals) *cobra.Command {
	var dev, noCache bool
	var tag, specFile string
	var timeout time.Duration
	c := &cobra.Command{
		Use:   "build [dev | agent] [--spec FILE]",
		Short: "Build an image in carreld and print its digest",
		Long: "Build the development image (dev, or --dev), an image from a built-in Debian spec (agent: a developer's " +
			"userland), or one from your own spec (--spec FILE, JSON; see docs/image-format.md). A Debian build whose " +
			"spec, package versions and tools have not changed is not run again (--no-cache runs it).",
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			req := &apiv1.BuildImageRequest{Tag: tag, NoCache: noCache}
			switch {
			case specFile != "" && (dev || len(args) > 0):
				return errors.New("--spec builds your own spec: name no other image")
			case specFile != "":
				b, err := os.ReadFile(specFile)
				if err != nil {
					return err
				}
				if _, err := debian.ParseSpec(b); err != nil {
					return fmt.Errorf("%s: %w", specFile, err)
				}
				req.SpecJson = string(b)
			case dev || (len(args) == 1 && args[0] == "dev"):
				req.Dev = true
			case len(args) == 1:
				req.SpecName = args[0]
			default:
				return fmt.Errorf("name what to build: dev, a built-in spec (%s), or --spec FILE", strings.Join(debian.BuiltinNames(), ", "))
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			resp, err := g.client().Images.BuildImage(ctx, connect.NewRequest(req))
			if err != nil {
				return err
			}
			if resp.Msg.Cached {
				fmt.Fprintf(cmd.ErrOrStderr(), "cached: the same spec, packages and tools built %s before\n", strings.Join(resp.Msg.Image.Tags, ","))
			}
			fmt.Println(resp.Msg.Image.Digest)
			return nil
		},
	}
	c.Flags().BoolVar(&dev, "dev", false, "build the development image (the same as naming dev)")
	c.Flags().StringVar(&specFile, "spec", "", "build from this spec file (JSON)")
	c.Flags().StringVar(&tag, "tag", "", "tag to point at the new image (default: dev, or the spec's name)")
	c.Flags().BoolVar(&noCache, "no-cache", false, "build even if the same build is cached")
	c.Flags().DurationVar(&timeout, "timeout", 30*time.Minute, "give up after this long")
	return c
}

func newImageListCmd(g *globals) *cobra.Command {
	var output string
	c := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List stored images",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return err
			}
			resp, err := g.client().Images.ListImages(cmd.Context(), connect.NewRequest(&apiv1.ListImagesRequest{}))
			if err != nil {
				return err
			}
			if output == "json" {
				return printJSON(cmd.OutOrStdout(), resp.Msg)
			}
			w := newTable()
			fmt.Fprintln(w, "NAME\tTAGS\tDIGEST\tROOT HASH\tSIZE\tPACKAGES\tKERNEL\tCREATED")
			for _, img := range resp.Msg.Images {
				name, root := img.Name, "-"
				if img.RootHash != "" {
					root = img.RootHash[:12]
				}
				if img.Error != "" {
					name = "(damaged: " + img.Error + ")"
				}
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%dM\t%d\t%s\t%s\n", name, strings.Join(img.Tags, ","), short(img.Digest), root,
					img.Size>>20, img.Packages, img.KernelVersion, img.CreatedAt)
			}
			return w.Flush()
		},
	}
	addOutputFlag(c, &output)
	return c
}

func newImageInspectCmd(g *globals) *cobra.Command {
	c := &cobra.Command{
		Use:   "inspect REF",
		Short: "Print a stored image's manifest: its parts, root hash, verity parameters and every package",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := g.client().Images.InspectImage(cmd.Context(), connect.NewRequest(&apiv1.InspectImageRequest{Ref: args[0]}))
			if err != nil {
				return err
			}
			return printManifest(cmd, resp.Msg.Image.Digest, resp.Msg.Image.Tags, []byte(resp.Msg.ManifestJson))
		},
	}
	return c
}

// printManifest prints a manifest as indented JSON, with the digest and
// tags it is known by.
func printManifest(cmd *cobra.Command, digest string, tags []string, raw []byte) error {
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil {
		return fmt.Errorf("manifest: %w", err)
	}
	out := map[string]any{"digest": digest, "manifest": m}
	if tags != nil {
		out["tags"] = tags
	}
	b, err := json.MarshalIndent(out, "", "  ")
	if err != nil {
		return err
	}
	_, err = fmt.Fprintln(cmd.OutOrStdout(), string(b))
	return err
}

func newImageCheckCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "check DIR",
		Short: "Check a directory in carrel's image format without importing it (hashes every part, recomputes the verity tree)",
		Long: "Check DIR against carrel's image format (docs/image-format.md): a valid manifest, exactly the parts it " +
			"names and nothing else, each of its stated size and digest, and a dm-verity hash tree and root hash that " +
			"recompute from the root file system. Runs here, without carreld.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			d, err := imagedir.Check(args[0])
			if err != nil {
				return err
			}
			m := d.Manifest
			root := "none (the initramfs is the root)"
			if m.Verity != nil {
				root = m.Verity.RootHash + " (" + m.Verity.Mount + ", verified)"
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: ok\n  name      %s\n  digest    %s\n  root hash %s\n  parts     %s\n  packages  %d\n",
				args[0], m.Name, d.Digest, root, partNames(m), len(m.Packages))
			return nil
		},
	}
}

func partNames(m *manifest.Manifest) string {
	var names []string
	for _, p := range m.Parts() {
		names = append(names, fmt.Sprintf("%s (%d bytes)", p.Name, p.Part.Size))
	}
	return strings.Join(names, ", ")
}

func newImageImportCmd(g *globals) *cobra.Command {
	var tag string
	c := &cobra.Command{
		Use:   "import DIR",
		Short: "Check an image directory built elsewhere (e.g. nix build .#agent-image) and store it in carreld",
		Long: "carreld reads DIR (on its own host), hashes every part, recomputes the dm-verity tree, and only then " +
			"stores the image and tags it (by default with the manifest's name). A failed import leaves the store " +
			"unchanged; importing the same image again changes nothing and says so.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			dir, err := filepath.Abs(args[0])
			if err != nil {
				return err
			}
			resp, err := g.client().Images.ImportImage(cmd.Context(), connect.NewRequest(&apiv1.ImportImageRequest{Path: dir, Tag: tag}))
			if err != nil {
				return err
			}
			img := resp.Msg.Image
			if resp.Msg.Already {
				fmt.Printf("%s already imported as %s: nothing changed\n", img.Digest, strings.Join(img.Tags, ","))
				return nil
			}
			fmt.Printf("%s imported as %s (root hash %s)\n", img.Digest, strings.Join(img.Tags, ","), img.RootHash)
			return nil
		},
	}
	c.Flags().StringVar(&tag, "tag", "", "tag to point at the image (default: the manifest's name)")
	return c
}
