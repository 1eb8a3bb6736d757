package main

import (
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strings"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/supervisor/client"
)

func newCpCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "cp SRC DST",
		Short: "Copy a file between the host and a VM; one side is NAME:/path",
		Long: `Copy a file or a directory between the host and a VM. One of SRC and DST is
NAME:/path in the guest, the other a host path, or - for stdin or stdout (files
only).

A file copied to an existing directory keeps its name; otherwise DST names the
new file. File writes in the guest are atomic: the file appears whole or not
at all. A directory is copied into DST (created if missing) under its own
name, as a tar stream; what comes from the guest is extracted beneath DST and
nowhere else, whatever the archive says.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			srcVM, src, srcGuest := splitGuest(args[0])
			dstVM, dst, dstGuest := splitGuest(args[1])
			switch {
			case srcGuest && dstGuest:
				return errors.New("cp: copy between two VMs through the host")
			case !srcGuest && !dstGuest:
				return errors.New("cp: one side must be NAME:/path in a VM")
			case srcGuest:
				return download(cmd, g, srcVM, src, dst)
			default:
				return upload(cmd, g, src, dstVM, dst)
			}
		},
	}
}

// splitGuest reads NAME:/path. Host paths with a colon can be written
// ./like:this.
func splitGuest(arg string) (vm, p string, ok bool) {
	name, rest, found := strings.Cut(arg, ":")
	if !found || client.ValidVMName(name) != nil || !strings.HasPrefix(rest, "/") {
		return "", arg, false
	}
	return name, rest, true
}

func download(cmd *cobra.Command, g *globals, vm, src, dst string) error {
	c, ctx := g.client(), cmd.Context()
	fi, err := c.Stat(ctx, vm, src)
	if err != nil {
		return err
	}
	switch {
	case fi.Type == agentv1.FileType_FILE_TYPE_DIRECTORY && dst != "-":
		_, err := c.DownloadTree(ctx, vm, src, dst, warnSkipped)
		return err
	case fi.Type != agentv1.FileType_FILE_TYPE_REGULAR:
		return fmt.Errorf("cp: %s:%s is not a regular file or a directory that can be copied there", vm, src)
	}
	if dst == "-" {
		_, err := c.Download(ctx, vm, src, os.Stdout)
		return err
	}
	dir, name := filepath.Split(dst)
	if st, err := os.Stat(dst); err == nil && st.IsDir() {
		dir, name = dst, path.Base(src)
	}
	if dir == "" {
		dir = "."
	}
	// Everything is written beneath the destination directory through an
	// os.Root, and only a complete file is renamed into place.
	root, err := os.OpenRoot(dir)
	if err != nil {
		return fmt.Errorf("cp: %w", err)
	}
	defer root.Close()
	tmp := fmt.Sprintf(".%s.carrel-cp-%d", name, os.Getpid())
	f, err := root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, os.FileMode(fi.Mode&0o777))
	if err != nil {
		return fmt.Errorf("cp: %w", err)
	}
	_, err = c.Download(ctx, vm, src, f)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = root.Rename(tmp, name)
	}
	if err != nil {
		root.Remove(tmp)
		return err
	}
	return nil
}

func upload(cmd *cobra.Command, g *globals, src, vm, dst string) error {
	c, ctx := g.client(), cmd.Context()
	in, mode := os.Stdin, uint32(0)
	if src != "-" {
		f, err := os.Open(src)
		if err != nil {
			return fmt.Errorf("cp: %w", err)
		}
		defer f.Close()
		st, err := f.Stat()
		if err != nil {
			return fmt.Errorf("cp: %w", err)
		}
		if st.IsDir() {
			_, err := c.UploadTree(ctx, vm, src, dst, warnSkipped)
			return err
		}
		if !st.Mode().IsRegular() {
			return fmt.Errorf("cp: %s is not a regular file or a directory", src)
		}
		in, mode = f, uint32(st.Mode().Perm())
	}
	fi, err := c.Stat(ctx, vm, dst)
	switch {
	case err == nil && fi.Type == agentv1.FileType_FILE_TYPE_DIRECTORY:
		name := "stdin"
		if src != "-" {
			name = filepath.Base(src)
		}
		dst = path.Join(dst, name)
	case err != nil && connect.CodeOf(err) != connect.CodeNotFound:
		return err
	}
	_, err = c.Upload(ctx, vm, dst, in, mode)
	return err
}

func warnSkipped(name, why string) {
	fmt.Fprintf(os.Stderr, "carrel cp: skipped %s: %s\n", name, why)
}
