package main

import (
	"github.com/spf13/cobra"
)

func newPolicyTestCmd() *cobra.Command {
	var verbose bool
	c := &cobra.Command{
		Use:   "test [DIR|NAME]...",
		Short: "Run a bundle's Rego tests with OPA's Go test runner (no opa binary needed)",
		Long: "Runs the test_* rules of each bundle: a directory, or a built-in policy by name.\n" +
			"A directory without .rego rules is data layered on the default rules. Without\n" +
			"arguments, the built-in policies are tested. (Runs carrel-policy, the engine.)",
		RunE: func(cmd *cobra.Command, args []string) error {
			if verbose {
				args = append([]string{"-v"}, args...)
			}
			return runPolicyEngine(cmd.OutOrStdout(), cmd.ErrOrStderr(), append([]string{"test"}, args...)...)
		},
	}
	c.Flags().BoolVarP(&verbose, "verbose", "v", false, "print every test, not only failures")
	return c
}

func newPolicyCheckCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "check DIR|NAME",
		Short: "Validate a bundle as carreld would before applying it: strict compile, required rules, its tests",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runPolicyEngine(cmd.OutOrStdout(), cmd.ErrOrStderr(), "check", args[0])
		},
	}
}
