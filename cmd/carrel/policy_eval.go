package main

import (
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/policy"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

func newPolicyEvalCmd(g *globals) *cobra.Command {
	var input, kind, pol, output string
	c := &cobra.Command{
		Use:   "eval --kind KIND --input FILE",
		Short: "Print the decision a policy makes for an input document, and why",
		Long: "Evaluates an input document (version 1, see docs/policy.md; - reads stdin).\n" +
			"--policy is a directory or a built-in policy, evaluated here, or the name of a\n" +
			"policy applied to carreld, evaluated there. Nothing is enforced or recorded.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(output); err != nil {
				return err
			}
			if !slices.Contains(policy.KindNames(), kind) {
				return fmt.Errorf("--kind must be one of %s", strings.Join(policy.KindNames(), ", "))
			}
			src, err := readInput(input)
			if err != nil {
				return err
			}
			var d *apiv1.Decision
			if b, lerr := loadBundle(pol); lerr == nil {
				p, err := policy.Compile(cmd.Context(), pol, b)
				if err != nil {
					return err
				}
				in, err := policy.DecodeInput(policy.Kind(kind), src)
				if err != nil {
					return err
				}
				dec, err := p.Decide(cmd.Context(), in)
				if err != nil {
					return err
				}
				d = &apiv1.Decision{Id: dec.ID, Kind: string(dec.Kind), Vm: dec.VM, Policy: dec.Policy, Revision: dec.Revision,
					InputDigest: dec.InputDigest, Allow: dec.Allow, Rule: dec.Rule, Reason: dec.Reason}
			} else {
				resp, err := g.client().Policies.EvalPolicy(cmd.Context(), connect.NewRequest(&apiv1.EvalPolicyRequest{Policy: pol, Kind: kind, Input: src}))
				if err != nil {
					return err
				}
				d = resp.Msg.Decision
			}
			if output == "json" {
				return printJSON(cmd.OutOrStdout(), d)
			}
			verdict := "deny"
			if d.Allow {
				verdict = "allow"
			}
			fmt.Printf("%s\nrule:     %s\nreason:   %s\npolicy:   %s (%s)\ninput:    %s\n", verdict, d.Rule, d.Reason, d.Policy, short(d.Revision), d.InputDigest)
			return nil
		},
	}
	c.Flags().StringVar(&input, "input", "", "input document, JSON (- for stdin)")
	c.Flags().StringVar(&kind, "kind", "", "api, exec, fs, net or guest")
	c.Flags().StringVar(&pol, "policy", policy.DefaultName, "a bundle directory, a built-in policy, or a policy applied to carreld")
	addOutputFlag(c, &output)
	c.MarkFlagRequired("input")
	c.MarkFlagRequired("kind")
	return c
}

func readInput(name string) ([]byte, error) {
	var r io.Reader = os.Stdin
	if name != "-" {
		f, err := os.Open(name)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		r = f
	}
	b, err := io.ReadAll(io.LimitReader(r, policy.MaxInputBytes+1))
	if err != nil {
		return nil, err
	}
	if len(b) > policy.MaxInputBytes {
		return nil, fmt.Errorf("input over %d bytes", policy.MaxInputBytes)
	}
	return b, nil
}
