package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/policy"
)

func newPolicyTestCmd() *cobra.Command {
	var verbose bool
	return &cobra.Command{
		Use:   "test [DIR|NAME]...",
		Short: "Run a bundle's Rego tests with OPA's Go test runner (no opa binary needed)",
		Long: "Runs the test_* rules of each bundle: a directory, or a built-in policy by name.\n" +
			"A directory without .rego rules is data layered on the default rules. Without\n" +
			"arguments, the built-in policies are tested.",
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				args = policy.BuiltinNames()
			}
			failed := 0
			for _, a := range args {
				b, err := loadBundle(a)
				if err != nil {
					return err
				}
				p, err := policy.Compile(cmd.Context(), a, b)
				if err != nil {
					return fmt.Errorf("%s: %w", a, err)
				}
				results, err := p.Test(cmd.Context())
				if err != nil {
					return fmt.Errorf("%s: %w", a, err)
				}
				failed += printResults(cmd.OutOrStdout(), a, results, verbose)
			}
			if failed > 0 {
				return exitError{code: 1}
			}
			return nil
		},
	}
}

// printResults prints failures (and with verbose every test) and a
// summary line; it returns how many failed.
func printResults(w io.Writer, name string, results []policy.TestResult, verbose bool) int {
	pass, fail, skip := 0, 0, 0
	var total time.Duration
	for _, r := range results {
		total += r.Duration
		switch {
		case r.Skip:
			skip++
		case r.Pass:
			pass++
			if verbose {
				fmt.Fprintf(w, "PASS %s (%s)\n", r.Name, r.Duration.Round(time.Microsecond))
			}
		default:
			fail++
			fmt.Fprintf(w, "FAIL %s: %s\n", r.Name, r.Error)
		}
	}
	verdict := "ok"
	if fail > 0 || len(results) == 0 {
		verdict = "FAIL"
	}
	fmt.Fprintf(w, "%-4s %s: %d passed, %d failed, %d skipped (%s)\n", verdict, name, pass, fail, skip, total.Round(time.Millisecond))
	if len(results) == 0 {
		fmt.Fprintf(w, "FAIL %s: no tests (rules named test_*)\n", name)
		return 1
	}
	return fail
}

func newPolicyCheckCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "check DIR|NAME",
		Short: "Validate a bundle as carreld would before applying it: strict compile, required rules, its tests",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			b, err := loadBundle(args[0])
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 5*time.Minute)
			defer cancel()
			_, results, err := policy.Check(ctx, args[0], b)
			if results != nil {
				printResults(cmd.OutOrStdout(), args[0], results, false)
			}
			if err != nil {
				if errors.Is(err, policy.ErrInvalidBundle) {
					return fmt.Errorf("%s would be rejected: %w", args[0], err)
				}
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "ok   %s can be applied (revision %s)\n", args[0], b.Revision)
			return nil
		},
	}
}
