package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/image/pack"
)

func newImagePackCmd() *cobra.Command {
	var (
		p       pack.Parts
		out     string
		closure string
	)
	c := &cobra.Command{
		Use:   "pack --out DIR --name NAME --kernel FILE --kernel-version VER --initrd FILE --system FILE|DIR [flags]",
		Short: "Make an image directory in carrel's format from a kernel, an initramfs and a file system built elsewhere",
		Long: "Writes DIR in carrel's image format (docs/image-format.md) from parts a builder made: the kernel, the " +
			"initramfs, and the system file system, an erofs image or a directory to make one of (reproducibly, with " +
			"carrel's own mkfs.erofs options). It computes the dm-verity hash tree, adds the root hash and the disks' " +
			"names to the command line, writes the workspace template and the manifest. The NixOS flake's " +
			"agent-image derivation runs it (nix/pack-image.sh); carrel's own builders use the same code. Runs here, " +
			"without carreld; check the result with `carrel image check DIR`.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if out == "" {
				return fmt.Errorf("--out is required")
			}
			if closure != "" {
				f, err := os.Open(closure)
				if err != nil {
					return err
				}
				defer f.Close()
				if p.Packages, err = pack.NixPackages(f); err != nil {
					return fmt.Errorf("%s: %w", closure, err)
				}
			}
			m, err := pack.Pack(cmd.Context(), out, p)
			if err != nil {
				return err
			}
			b, err := m.Marshal()
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: packed\n  name      %s\n  digest    %s\n  root hash %s (%s)\n  parts     %s\n  packages  %d\n",
				out, m.Name, manifest.DigestBytes(b), m.Verity.RootHash, m.Verity.Mount, partNames(m), len(m.Packages))
			return nil
		},
	}
	f := c.Flags()
	f.StringVar(&out, "out", "", "the image directory to write (created; an image there is replaced)")
	f.StringVar(&p.Name, "name", "", "the image's name, which carreld tags it with")
	f.StringVar(&p.Kernel, "kernel", "", "the kernel (bzImage)")
	f.StringVar(&p.KernelVersion, "kernel-version", "", "the kernel's release, as uname -r gives it")
	f.StringVar(&p.Initrd, "initrd", "", "the initramfs")
	f.StringVar(&p.System, "system", "", "the file system dm-verity covers: an erofs image, or a directory to make one of")
	f.StringVar(&p.Mount, "mount", manifest.MountRoot, "what the system file system is in the guest: root, or usr (a /usr or Nix store, as NixOS's usrhash= mounts it)")
	f.StringVar(&p.Cmdline, "cmdline", "", "the image's kernel command line (init=, console=, hardening parameters); the verity words are added")
	f.StringVar(&p.Erofs.Compressor, "compress", "", "compress a file system made from a directory: an mkfs.erofs compressor such as lz4hc; none by default (fastest under TCG)")
	f.BoolVar(&p.Erofs.AllRoot, "all-root", false, "make root the owner of every file of a file system made from a directory (a tree copied by an unprivileged build)")
	f.Int64Var(&p.Erofs.Epoch, "epoch", 0, "the timestamp of every file of a file system made from a directory")
	f.StringVar(&closure, "closure", "", "a Nix closure's store paths, one per line (closureInfo's store-paths): the manifest's package list")
	f.BoolVar(&p.NoWorkspace, "no-workspace", false, "write no workspace template")
	return c
}
