// carrel-policy runs the policy engine (OPA) for the carrel CLI, which does
// not link it, so that every other carrel command starts without it.
// `carrel policy test`, `carrel policy check` and `carrel policy eval` of a
// local bundle run this program, found beside carrel or on PATH:
//
//	carrel-policy test [-v] [DIR|NAME]...   run bundles' Rego tests
//	carrel-policy check DIR|NAME            validate a bundle as carreld would
//	carrel-policy eval KIND DIR|NAME        decide the input document on stdin;
//	                                        the decision goes to stdout as JSON
//
// A NAME is a built-in policy. The exit status is 0 on success, 1 when a
// test fails or a bundle would be rejected, and 2 for bad usage.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/policy/bundle"
)

func main() {
	ctx := context.Background()
	if len(os.Args) < 2 {
		usage()
	}
	var err error
	code := 0
	switch cmd, args := os.Args[1], os.Args[2:]; cmd {
	case "test":
		fs := flag.NewFlagSet("test", flag.ExitOnError)
		verbose := fs.Bool("v", false, "print every test, not only failures")
		fs.Parse(args)
		code, err = test(ctx, os.Stdout, fs.Args(), *verbose)
	case "check":
		if len(args) != 1 {
			usage()
		}
		code, err = check(ctx, os.Stdout, args[0])
	case "eval":
		if len(args) != 2 {
			usage()
		}
		err = eval(ctx, os.Stdin, os.Stdout, policy.Kind(args[0]), args[1])
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "carrel policy:", err)
		code = 1
	}
	os.Exit(code)
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: carrel-policy test [-v] [DIR|NAME]... | check DIR|NAME | eval KIND DIR|NAME < input.json")
	os.Exit(2)
}

// test runs each bundle's test_* rules; the built-in policies without
// arguments.
func test(ctx context.Context, w io.Writer, args []string, verbose bool) (int, error) {
	if len(args) == 0 {
		args = bundle.BuiltinNames()
	}
	failed := 0
	for _, a := range args {
		b, err := bundle.Load(a)
		if err != nil {
			return 0, err
		}
		p, err := policy.Compile(ctx, a, b)
		if err != nil {
			return 0, fmt.Errorf("%s: %w", a, err)
		}
		results, err := p.Test(ctx)
		if err != nil {
			return 0, fmt.Errorf("%s: %w", a, err)
		}
		failed += printResults(w, a, results, verbose)
	}
	if failed > 0 {
		return 1, nil
	}
	return 0, nil
}

// check validates a bundle as carreld does before applying it: strict
// compile, the required rules, its tests.
func check(ctx context.Context, w io.Writer, arg string) (int, error) {
	b, err := bundle.Load(arg)
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	_, results, err := policy.Check(ctx, arg, b)
	if results != nil {
		printResults(w, arg, results, false)
	}
	if err != nil {
		if errors.Is(err, policy.ErrInvalidBundle) {
			return 0, fmt.Errorf("%s would be rejected: %w", arg, err)
		}
		return 0, err
	}
	fmt.Fprintf(w, "ok   %s can be applied (revision %s)\n", arg, b.Revision)
	return 0, nil
}

// Decision is what eval writes: the fields of the API's Decision, in its
// JSON names, for carrel to print as it prints carreld's.
type Decision struct {
	ID          string `json:"id"`
	Kind        string `json:"kind"`
	VM          string `json:"vm,omitempty"`
	Policy      string `json:"policy"`
	Revision    string `json:"revision"`
	InputDigest string `json:"inputDigest"`
	Allow       bool   `json:"allow,omitempty"`
	Rule        string `json:"rule"`
	Reason      string `json:"reason"`
}

// eval decides the input document in r with a local bundle.
func eval(ctx context.Context, r io.Reader, w io.Writer, kind policy.Kind, arg string) error {
	if !slices.Contains(policy.KindNames(), string(kind)) {
		return fmt.Errorf("--kind must be one of %s", strings.Join(policy.KindNames(), ", "))
	}
	src, err := io.ReadAll(io.LimitReader(r, policy.MaxInputBytes+1))
	if err != nil {
		return err
	}
	if len(src) > policy.MaxInputBytes {
		return fmt.Errorf("input over %d bytes", policy.MaxInputBytes)
	}
	b, err := bundle.Load(arg)
	if err != nil {
		return err
	}
	p, err := policy.Compile(ctx, arg, b)
	if err != nil {
		return err
	}
	in, err := policy.DecodeInput(kind, src)
	if err != nil {
		return err
	}
	d, err := p.Decide(ctx, in)
	if err != nil {
		return err
	}
	return json.NewEncoder(w).Encode(Decision{ID: d.ID, Kind: string(d.Kind), VM: d.VM, Policy: d.Policy, Revision: d.Revision,
		InputDigest: d.InputDigest, Allow: d.Allow, Rule: d.Rule, Reason: d.Reason})
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
