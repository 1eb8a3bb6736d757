package main

import (
	"fmt"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
	"github.com/carrel-os/carrel/supervisor/identity"
)

func newTokenCmd(g *globals) *cobra.Command {
	c := &cobra.Command{Use: "token", Short: "Issue, list and revoke tokens scoped to one VM, for agent harnesses"}
	c.AddCommand(newTokenCreateCmd(g), newTokenListCmd(g), newTokenRevokeCmd(g))
	return c
}

func newTokenCreateCmd(g *globals) *cobra.Command {
	var ttl time.Duration
	c := &cobra.Command{
		Use:   "create VM",
		Short: "Issue a token for VM and print its secret (shown once; pass it as CARREL_TOKEN)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := g.client().Tokens.CreateToken(cmd.Context(), connect.NewRequest(&apiv1.CreateTokenRequest{Vm: args[0], TtlSeconds: uint64(ttl / time.Second)}))
			if err != nil {
				return err
			}
			fmt.Println(resp.Msg.Secret)
			return nil
		},
	}
	c.Flags().DurationVar(&ttl, "ttl", 0, "expire after this long (0: never)")
	return c
}

func newTokenListCmd(g *globals) *cobra.Command {
	return newListTokensCmd(g, false, "List tokens (ids and scopes; never secrets)")
}

// newListTokensCmd lists the VM tokens, or, with keys, the API keys.
func newListTokensCmd(g *globals, keys bool, short string) *cobra.Command {
	var output string
	c := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   short,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return err
			}
			resp, err := g.client().Tokens.ListTokens(cmd.Context(), connect.NewRequest(&apiv1.ListTokensRequest{}))
			if err != nil {
				return err
			}
			var list []*apiv1.Token
			for _, t := range resp.Msg.Tokens {
				if (t.KeyName != "") == keys {
					list = append(list, t)
				}
			}
			if output == "json" {
				return printJSON(cmd.OutOrStdout(), &apiv1.ListTokensResponse{Tokens: list})
			}
			w := newTable()
			if keys {
				fmt.Fprintln(w, "ID\tNAME\tIMAGES\tPOLICY\tLIMITS\tCREATED\tEXPIRES")
			} else {
				fmt.Fprintln(w, "ID\tVM\tCREATED\tEXPIRES")
			}
			for _, t := range list {
				if keys {
					fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", t.Id, t.KeyName, strings.Join(t.Images, ","), dash(t.Policy), limitsText(t.Limits), t.CreatedAt, dash(t.ExpiresAt))
				} else {
					fmt.Fprintf(w, "%s\t%s\t%s\t%s\n", t.Id, t.Vm, t.CreatedAt, dash(t.ExpiresAt))
				}
			}
			return w.Flush()
		},
	}
	addOutputFlag(c, &output)
	return c
}

// limitsText writes a key's limits as its flags would give them.
func limitsText(l *apiv1.KeyLimits) string {
	return identity.Limits{VMs: l.GetVms(), Snapshots: l.GetSnapshots(), MemoryBytes: l.GetMemoryBytes(), DiskBytes: l.GetDiskBytes()}.String()
}

func newTokenRevokeCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "revoke ID",
		Short: "Revoke a token; it stops working at once",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			_, err := g.client().Tokens.RevokeToken(cmd.Context(), connect.NewRequest(&apiv1.RevokeTokenRequest{Id: args[0]}))
			return err
		},
	}
}

func newKeyCmd(g *globals) *cobra.Command {
	c := &cobra.Command{Use: "key", Short: "Issue, list and revoke API keys: identities that create and own VMs of their own (the e2b API)"}
	c.AddCommand(newKeyCreateCmd(g), newKeyListCmd(g), newKeyRevokeCmd(g))
	return c
}

func newKeyCreateCmd(g *globals) *cobra.Command {
	var ttl time.Duration
	var images []string
	var pol, maxMemory, maxDisk string
	var lim apiv1.KeyLimits
	c := &cobra.Command{
		Use:   "create NAME",
		Short: "Issue an API key for the identity NAME and print it (shown once; pass it as E2B_API_KEY)",
		Long: "Issue an API key (e2b_<hex>) for the identity NAME. A key creates VMs of its own, named\n" +
			"e2b-NAME-..., from the images --image names, bound to --policy, and acts on those VMs alone.\n" +
			"Keys of one name share its VMs, so a key can be replaced by a new one of the same name.\n\n" +
			"The --max-* flags cap what NAME's VMs hold together: VMs in any state, snapshots across\n" +
			"them, and the sum of their memory and of their disks (each VM's --disk, 8G by default and\n" +
			"none when ephemeral, plus its --workspace, half its memory by default, as created). 0, the\n" +
			"default, is no limit. carreld refuses a create or snapshot that would go over one, naming\n" +
			"it (the e2b API answers 429). Keys of one name must give the same images, policy and\n" +
			"limits: to change them, revoke its keys and issue a new one.",
		Example: "  carrel key create alice --image agent --max-vms 4 --max-snapshots 8 --max-memory 16G --max-disk 100G",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var err error
			if maxMemory != "" {
				if lim.MemoryBytes, err = parseSize(maxMemory); err != nil {
					return fmt.Errorf("--max-memory: %w", err)
				}
			}
			if maxDisk != "" {
				if lim.DiskBytes, err = parseSize(maxDisk); err != nil {
					return fmt.Errorf("--max-disk: %w", err)
				}
			}
			resp, err := g.client().Tokens.CreateToken(cmd.Context(), connect.NewRequest(&apiv1.CreateTokenRequest{
				KeyName: args[0], Images: images, Policy: pol, TtlSeconds: uint64(ttl / time.Second), Limits: &lim}))
			if err != nil {
				return err
			}
			fmt.Println(resp.Msg.Secret)
			return nil
		},
	}
	c.Flags().StringArrayVar(&images, "image", nil, "an image tag (an e2b template) its VMs may boot; repeatable; \"*\" for any")
	c.Flags().StringVar(&pol, "policy", "default", "the policy its VMs are bound to")
	c.Flags().DurationVar(&ttl, "ttl", 0, "expire after this long (0: never)")
	c.Flags().Uint64Var(&lim.Vms, "max-vms", 0, "the most VMs NAME may have, in any state (0: no limit)")
	c.Flags().Uint64Var(&lim.Snapshots, "max-snapshots", 0, "the most snapshots NAME's VMs may have together (0: no limit)")
	c.Flags().StringVar(&maxMemory, "max-memory", "", "the most memory NAME's VMs may have together, e.g. 16G (0 or none: no limit)")
	c.Flags().StringVar(&maxDisk, "max-disk", "", "the most disk NAME's VMs may have together, e.g. 100G: their --disk and --workspace sizes (0 or none: no limit)")
	return c
}

func newKeyListCmd(g *globals) *cobra.Command {
	return newListTokensCmd(g, true, "List API keys (ids, names and grants; never secrets)")
}

func newKeyRevokeCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "revoke ID",
		Short: "Revoke an API key; it, and the sandbox tokens made from it, stop working at once",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			_, err := g.client().Tokens.RevokeToken(cmd.Context(), connect.NewRequest(&apiv1.RevokeTokenRequest{Id: args[0]}))
			return err
		},
	}
}
