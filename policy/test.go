package policy

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/open-policy-agent/opa/v1/ast"
	"github.com/open-policy-agent/opa/v1/tester"
)

// TestTimeout bounds each Rego test.
const TestTimeout = 10 * time.Second

// TestResult is one Rego test's outcome.
type TestResult struct {
	Name     string        `json:"name"` // package.test_name
	Pass     bool          `json:"pass"`
	Skip     bool          `json:"skip,omitempty"`
	Error    string        `json:"error,omitempty"`
	Duration time.Duration `json:"duration_ns"`
}

// Test runs the bundle's Rego tests (rules named test_*) with OPA's own
// test runner, against the bundle's data. No opa binary is needed.
func (p *Policy) Test(ctx context.Context) ([]TestResult, error) {
	ch, err := tester.NewRunner().
		SetCompiler(p.compiler).
		SetStore(p.store).
		SetDefaultRegoVersion(ast.RegoV1).
		SetTimeout(TestTimeout).
		RaiseBuiltinErrors(true).
		SetModules(p.compiler.Modules).
		RunTests(ctx, nil)
	if err != nil {
		return nil, fmt.Errorf("policy %s: run tests: %w", p.Name, err)
	}
	var out []TestResult
	for r := range ch {
		tr := TestResult{Name: strings.TrimPrefix(r.Package, "data.") + "." + r.Name, Pass: r.Pass(), Skip: r.Skip, Duration: r.Duration}
		if r.Error != nil {
			tr.Error = r.Error.Error()
		} else if r.Fail {
			tr.Error = "failed"
			if r.FailedAt != nil {
				tr.Error = fmt.Sprintf("failed at %v: %v", r.FailedAt.Location, r.FailedAt)
			}
		}
		out = append(out, tr)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// Check compiles a bundle and runs its tests: what a bundle must pass
// before it may replace a running one. It fails if any test fails or the
// bundle has no tests at all.
func Check(ctx context.Context, name string, b *Bundle) (*Policy, []TestResult, error) {
	p, err := Compile(ctx, name, b)
	if err != nil {
		return nil, nil, err
	}
	results, err := p.Test(ctx)
	if err != nil {
		return nil, results, err
	}
	if len(results) == 0 {
		return nil, results, fmt.Errorf("%w: no Rego tests (rules named test_*)", ErrInvalidBundle)
	}
	var failed []string
	for _, r := range results {
		if !r.Pass && !r.Skip {
			failed = append(failed, r.Name)
		}
	}
	if len(failed) > 0 {
		return nil, results, fmt.Errorf("%w: %d of %d tests failed: %s", ErrInvalidBundle, len(failed), len(results), strings.Join(failed, ", "))
	}
	return p, results, nil
}
