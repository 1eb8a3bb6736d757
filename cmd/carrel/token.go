package main

import (
	"fmt"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
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
	var output string
	c := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List tokens (ids and scopes; never secrets)",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return err
			}
			resp, err := g.client().Tokens.ListTokens(cmd.Context(), connect.NewRequest(&apiv1.ListTokensRequest{}))
			if err != nil {
				return err
			}
			if output == "json" {
				return printJSON(cmd.OutOrStdout(), resp.Msg)
			}
			w := newTable()
			fmt.Fprintln(w, "ID\tVM\tCREATED\tEXPIRES")
			for _, t := range resp.Msg.Tokens {
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\n", t.Id, t.Vm, t.CreatedAt, dash(t.ExpiresAt))
			}
			return w.Flush()
		},
	}
	addOutputFlag(c, &output)
	return c
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
