package main

import (
	"fmt"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/supervisor/bytesize"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

func newVMCreateCmd(g *globals) *cobra.Command {
	var image, memory, pol, workspace, disk string
	var ephemeral bool
	var cpus uint32
	var procs uint64
	var gpus, env, labels []string
	var ttl time.Duration
	var expiry string
	c := &cobra.Command{
		Use:   "create NAME",
		Short: "Create a VM and boot it; returns once its agent is ready",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			mem, err := parseSize(memory)
			if err != nil {
				return fmt.Errorf("--memory: %w", err)
			}
			var ws uint64
			if workspace != "" {
				if ws, err = parseSize(workspace); err != nil {
					return fmt.Errorf("--workspace: %w", err)
				}
			}
			var diskBytes uint64
			if disk != "" {
				if diskBytes, err = parseSize(disk); err != nil {
					return fmt.Errorf("--disk: %w", err)
				}
			}
			lm := map[string]string{}
			for _, kv := range labels {
				k, v, ok := strings.Cut(kv, "=")
				if !ok {
					return fmt.Errorf("--label %q: want KEY=VALUE", kv)
				}
				lm[k] = v
			}
			action := apiv1.ExpiryAction_EXPIRY_ACTION_DELETE
			switch expiry {
			case "delete":
			case "stop":
				action = apiv1.ExpiryAction_EXPIRY_ACTION_STOP
			default:
				return fmt.Errorf("--at-expiry %q: want delete or stop", expiry)
			}
			resp, err := g.client().VMs.CreateVM(cmd.Context(), connect.NewRequest(&apiv1.CreateVMRequest{
				Name: args[0], Image: image, MemoryBytes: mem, Cpus: cpus, Policy: pol,
				WorkspaceBytes: ws, MaxProcesses: procs, Gpus: gpuAddresses(gpus),
				Ephemeral: ephemeral, DiskBytes: diskBytes,
				Env: env, Labels: lm, TtlSeconds: uint64(ttl / time.Second), ExpiryAction: action,
			}))
			if err != nil {
				return err
			}
			v := resp.Msg.Vm
			withGPUs := ""
			if len(v.Gpus) > 0 {
				withGPUs = ", gpus " + strings.Join(v.Gpus, " ")
			}
			fmt.Printf("%s %s (image %s, policy %s, pid %d, %s%s)\n", v.Name, stateName(v.State), short(v.ImageDigest), v.Policy, v.Pid, v.Accelerator, withGPUs)
			return nil
		},
	}
	c.Flags().StringVar(&image, "image", "dev", "image tag or digest")
	c.Flags().StringVar(&memory, "memory", "512M", "guest memory, e.g. 512M or 2G")
	c.Flags().Uint32Var(&cpus, "cpus", 1, "virtual CPUs")
	c.Flags().StringVar(&workspace, "workspace", "", "size of the guest's /workspace, e.g. 1G (default: half the memory)")
	c.Flags().StringVar(&disk, "disk", "", "size of the disk that keeps what the VM changes outside /workspace, e.g. 20G (default 8G; sparse)")
	c.Flags().BoolVar(&ephemeral, "ephemeral", false, "keep what the VM changes outside /workspace in memory: gone at every stop")
	c.Flags().Uint64Var(&procs, "max-processes", 0, "processes and threads the VM's commands may have together (default: no limit)")
	c.Flags().StringVar(&pol, "policy", "default", "the policy that decides everything done in the VM (see carrel policy ls)")
	c.Flags().StringArrayVar(&env, "env", nil, "KEY=VALUE every command in the VM gets, under its own (repeatable)")
	c.Flags().StringArrayVar(&labels, "label", nil, "KEY=VALUE label to find the VM by (repeatable)")
	c.Flags().DurationVar(&ttl, "ttl", 0, "end the VM this long after its creation (see --at-expiry; carrel vm expire moves it)")
	c.Flags().StringVar(&expiry, "at-expiry", "delete", "what carreld does when the VM's time is up: delete or stop")
	c.Flags().StringArrayVar(&gpus, "gpu", nil, "pass through the GPU at this PCI address, e.g. 0000:41:00.0, with the other functions of its slot (repeatable; see carrel gpu ls)")
	return c
}

// parseSize reads sizes such as 512M, 2G, 2GiB or 1048576 (bytes when no
// unit; binary units).
func parseSize(s string) (uint64, error) { return bytesize.Parse(s) }

func short(digest string) string {
	if len(digest) > 19 {
		return digest[:19]
	}
	return digest
}

func newVMExpireCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "expire NAME TTL",
		Short: "End the VM TTL from now (e.g. 30m), as it was created to (delete or stop); 0 keeps it for good",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ttl, err := time.ParseDuration(args[1])
			if err != nil || ttl < 0 {
				return fmt.Errorf("TTL %q: want a duration such as 30m, or 0", args[1])
			}
			resp, err := g.client().VMs.SetVMExpiry(cmd.Context(), connect.NewRequest(&apiv1.SetVMExpiryRequest{Name: args[0], TtlSeconds: uint64(ttl / time.Second)}))
			if err != nil {
				return err
			}
			if at := resp.Msg.Vm.ExpiresAt; at != "" {
				fmt.Printf("%s expires at %s\n", args[0], at)
			} else {
				fmt.Printf("%s does not expire\n", args[0])
			}
			return nil
		},
	}
}
