package main

import (
	"errors"
	"fmt"
	"strings"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

func newImageCmd(g *globals) *cobra.Command {
	c := &cobra.Command{Use: "image", Short: "Build and list images"}
	c.AddCommand(newImageBuildCmd(g), newImageListCmd(g))
	return c
}

func newImageBuildCmd(g *globals) *cobra.Command {
	var dev bool
	var tag string
	c := &cobra.Command{
		Use:   "build --dev",
		Short: "Build the development image and print its digest",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if !dev {
				return errors.New("only the development image can be built by carreld: pass --dev (production images are built with nix build .#image)")
			}
			resp, err := g.client().Images.BuildImage(cmd.Context(), connect.NewRequest(&apiv1.BuildImageRequest{Dev: true, Tag: tag}))
			if err != nil {
				return err
			}
			fmt.Println(resp.Msg.Image.Digest)
			return nil
		},
	}
	c.Flags().BoolVar(&dev, "dev", false, "build the development image (Debian kernel + busybox + carrel-agent)")
	c.Flags().StringVar(&tag, "tag", "dev", "tag to point at the new image")
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
			fmt.Fprintln(w, "DIGEST\tTAGS\tKERNEL\tSIZE\tCREATED")
			for _, img := range resp.Msg.Images {
				fmt.Fprintf(w, "%s\t%s\t%s\t%dM\t%s\n", short(img.Digest), strings.Join(img.Tags, ","), img.KernelVersion, img.Size>>20, img.CreatedAt)
			}
			return w.Flush()
		},
	}
	addOutputFlag(c, &output)
	return c
}
