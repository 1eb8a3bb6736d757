package main

import (
	"strings"

	"github.com/spf13/cobra"

	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

func newVMCmd(g *globals) *cobra.Command {
	c := &cobra.Command{Use: "vm", Short: "Create, list, start, stop, pause, snapshot, restore, fork and remove VMs; read their consoles"}
	c.AddCommand(newVMCreateCmd(g), newVMExpireCmd(g), newVMListCmd(g), newVMInspectCmd(g), newVMStartCmd(g), newVMStopCmd(g), newVMResetCmd(g), newVMPauseCmd(g), newVMResumeCmd(g),
		newVMSnapshotCmd(g), newVMRestoreCmd(g), newVMForkCmd(g), newVMConsoleCmd(g), newVMRemoveCmd(g))
	return c
}

// stateName is a VM state as people read it ("running").
func stateName(s apiv1.VMState) string {
	return strings.ToLower(strings.TrimPrefix(s.String(), "VM_STATE_"))
}

func agentName(s apiv1.AgentState) string {
	return strings.ToLower(strings.TrimPrefix(s.String(), "AGENT_STATE_"))
}
