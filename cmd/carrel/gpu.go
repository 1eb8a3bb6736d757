package main

import (
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

func newGPUCmd(g *globals) *cobra.Command {
	c := &cobra.Command{Use: "gpu", Short: "List the host's GPUs, for carrel vm create --gpu"}
	c.AddCommand(newGPUListCmd(g))
	return c
}

func newGPUListCmd(g *globals) *cobra.Command {
	var output string
	c := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List the PCI display and 3D controllers, their IOMMU groups and drivers, and whether each can be passed through",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return err
			}
			resp, err := g.client().GPUs.ListGPUs(cmd.Context(), connect.NewRequest(&apiv1.ListGPUsRequest{}))
			if err != nil {
				return err
			}
			if output == "json" {
				return printJSON(cmd.OutOrStdout(), resp.Msg)
			}
			if !resp.Msg.Iommu {
				fmt.Fprintln(os.Stderr, "the IOMMU is off: no GPU can be passed through (see GPU passthrough in docs/operator-guide.md)")
			}
			return writeGPUTable(cmd.OutOrStdout(), resp.Msg)
		},
	}
	addOutputFlag(c, &output)
	return c
}

// writeGPUTable writes one GPU a line. ASSIGNABLE comes last: its reason
// can be long.
func writeGPUTable(out io.Writer, resp *apiv1.ListGPUsResponse) error {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "ADDRESS\tNAME\tIOMMU GROUP\tDRIVER\tVM\tASSIGNABLE")
	for _, g := range resp.Gpus {
		name := "[" + g.Ids + "]"
		if g.Name != "" {
			name = g.Name + " " + name
		}
		group := "-"
		if g.IommuGroup >= 0 {
			group = fmt.Sprint(g.IommuGroup)
		}
		assignable := "yes"
		switch {
		case !g.Assignable:
			assignable = "no: " + g.Reason
		case g.BootVga:
			assignable = "yes (the host's boot display: its console goes with it)"
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\n", g.Address, protocol.CleanText(name, maxGPUText), group, dash(g.Driver), dash(g.Vm), protocol.CleanText(assignable, maxGPUText))
	}
	return w.Flush()
}

// maxGPUText bounds a device name or reason shown from carreld.
const maxGPUText = 256

// gpuAddresses adds the domain to addresses in lspci's short form
// ("41:00.0"), which carreld does not take: it names every device in
// full.
func gpuAddresses(in []string) []string {
	out := make([]string, len(in))
	for i, s := range in {
		if strings.Count(s, ":") == 1 {
			s = "0000:" + s
		}
		out[i] = s
	}
	return out
}
