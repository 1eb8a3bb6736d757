package main

import (
	"fmt"
	"io"
	"os"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/policy/bundle"
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
			src, err := readInput(input)
			if err != nil {
				return err
			}
			var d *apiv1.Decision
			if _, lerr := bundle.Load(pol); lerr == nil {
				if d, err = evalLocal(kind, pol, src, cmd.ErrOrStderr()); err != nil {
					return err
				}
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
	c.Flags().StringVar(&pol, "policy", bundle.DefaultName, "a bundle directory, a built-in policy (evaluated here, by carrel-policy), or a policy applied to carreld")
	addOutputFlag(c, &output)
	c.MarkFlagRequired("input")
	c.MarkFlagRequired("kind")
	return c
}

// maxInputBytes caps an input document: carreld takes no larger (its
// request cap, and policy.MaxInputBytes).
const maxInputBytes = 1 << 20

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
	b, err := io.ReadAll(io.LimitReader(r, maxInputBytes+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxInputBytes {
		return nil, fmt.Errorf("input over %d bytes", maxInputBytes)
	}
	return b, nil
}
