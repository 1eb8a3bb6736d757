package main

import (
	"fmt"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

func newVMSnapshotCmd(g *globals) *cobra.Command {
	var name, note string
	c := &cobra.Command{
		Use:   "snapshot VM --name NAME",
		Short: "Save a running VM at one instant: memory, devices and every writable disk",
		Long: "Save the VM at one instant: its vCPUs stop, its writable disks are frozen (it goes on over new " +
			"overlays), its memory and device state are saved, and it runs on. Restore it with carrel vm restore, " +
			"or make a new VM from it with carrel vm fork.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := g.client().VMs.SnapshotVM(cmd.Context(), connect.NewRequest(&apiv1.SnapshotVMRequest{Name: args[0], Snapshot: name, Note: note}))
			if err != nil {
				return err
			}
			s := resp.Msg.Snapshot
			fmt.Printf("%s: snapshot %s taken (%s; state %s, sha256 %s)\n", s.Vm, s.Name, mib(s.Bytes), mib(s.StateBytes), s.StateSha256[:12])
			return nil
		},
	}
	c.Flags().StringVar(&name, "name", "", "the snapshot's name (required)")
	c.Flags().StringVar(&note, "note", "", "words to keep with it")
	_ = c.MarkFlagRequired("name")
	c.AddCommand(newVMSnapshotListCmd(g), newVMSnapshotRemoveCmd(g))
	return c
}

func newVMSnapshotListCmd(g *globals) *cobra.Command {
	var output string
	c := &cobra.Command{
		Use:     "ls VM",
		Aliases: []string{"list"},
		Short:   "List a VM's snapshots, oldest first",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return err
			}
			resp, err := g.client().VMs.ListSnapshots(cmd.Context(), connect.NewRequest(&apiv1.ListSnapshotsRequest{Name: args[0]}))
			if err != nil {
				return err
			}
			if output == "json" {
				return printJSON(cmd.OutOrStdout(), resp.Msg)
			}
			w := newTable()
			fmt.Fprintln(w, "NAME\tCREATED\tSIZE\tPARENT SESSION\tBY\tNOTE")
			for _, s := range resp.Msg.Snapshots {
				created := s.CreatedAt
				if t, err := time.Parse(time.RFC3339Nano, s.CreatedAt); err == nil {
					created = t.Local().Format("2006-01-02 15:04:05")
				}
				by := "operator"
				if s.Guest {
					by = "guest"
				}
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\n", s.Name, created, mib(s.Bytes), s.Session, by, s.Note)
			}
			return w.Flush()
		},
	}
	addOutputFlag(c, &output)
	return c
}

func newVMSnapshotRemoveCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:     "rm VM NAME",
		Aliases: []string{"remove"},
		Short:   "Delete a snapshot (its disk layers stay while a VM stands on them)",
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if _, err := g.client().VMs.DeleteSnapshot(cmd.Context(), connect.NewRequest(&apiv1.DeleteSnapshotRequest{Name: args[0], Snapshot: args[1]})); err != nil {
				return err
			}
			fmt.Printf("%s: snapshot %s deleted\n", args[0], args[1])
			return nil
		},
	}
}

func newVMRestoreCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "restore VM SNAPSHOT",
		Short: "Put a VM back at a snapshot, processes and all",
		Long: "Put the VM back at the snapshot's instant, in a new session whose parent is the snapshot's. " +
			"What it did since is discarded; a running VM's QEMU is replaced. A damaged snapshot is refused " +
			"before anything changes.",
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := g.client().VMs.RestoreVM(cmd.Context(), connect.NewRequest(&apiv1.RestoreVMRequest{Name: args[0], Snapshot: args[1]}))
			if err != nil {
				return err
			}
			v := resp.Msg.Vm
			fmt.Printf("%s restored to %s, %s (session %s)\n", v.Name, args[1], stateName(v.State), v.Session)
			return nil
		},
	}
}

func newVMForkCmd(g *globals) *cobra.Command {
	var snapshot string
	c := &cobra.Command{
		Use:   "fork VM NEW",
		Short: "Make a second, independent VM from a VM's moment (now, or a snapshot)",
		Long: "Make a new VM from a snapshot of VM, or from a snapshot taken now (named fork-NEW): the same " +
			"machine at that instant, processes and all, with its own name, session, disks, random seed, clock " +
			"and machine id.",
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := g.client().VMs.ForkVM(cmd.Context(), connect.NewRequest(&apiv1.ForkVMRequest{Name: args[0], NewName: args[1], Snapshot: snapshot}))
			if err != nil {
				return err
			}
			v := resp.Msg.Vm
			from := ""
			if v.Origin != nil {
				from = " from snapshot " + v.Origin.Snapshot
			}
			fmt.Printf("%s forked from %s%s, %s (session %s)\n", v.Name, args[0], from, stateName(v.State), v.Session)
			return nil
		},
	}
	c.Flags().StringVar(&snapshot, "snapshot", "", "fork from this snapshot instead of taking one now")
	return c
}

// mib is a byte count in MiB, as people read it.
func mib(n uint64) string {
	return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
}
