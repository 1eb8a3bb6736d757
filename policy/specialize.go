package policy

// Per-VM settings, worked out at compile time.
//
// Much of what a decision reads depends on the bundle's data and the VM's
// name alone: a VM's settings (data.settings.<kind>, with its overrides
// from data.settings.vms merged over them) and tables derived from them.
// OPA works such rules out again on every evaluation. Compile works them
// out once instead: once for each VM that data.settings.vms names, and
// once for every other VM, and prepares each kind's decision query with
// those values in place (`with data.carrel.exec.settings as {...}`). An
// evaluation then runs only the rules that read the rest of its input.
//
// A rule is worked out this way only when Compile can show that its value
// cannot depend on anything else: the rules it reads, transitively, read
// input only as input.vm, and use input.vm only as the key in
// data.settings.vms[input.vm], so that every VM that data.settings.vms does
// not name sees the same value. Any other rule is left to OPA, as written,
// and so is a whole kind whose rules use `with` (see frontier).
// The rules stay the source of truth: Rego tests that override
// data.settings with `with` evaluate them as written, and a decision made
// with the worked-out values is the decision the rules give (the engine's
// tests check this on every bundle carrel ships).

import (
	"context"
	"fmt"
	"slices"

	"github.com/open-policy-agent/opa/v1/ast"
	"github.com/open-policy-agent/opa/v1/rego"
)

// kindQueries are one kind's prepared decision queries.
type kindQueries struct {
	// generic evaluates every rule as written.
	generic rego.PreparedEvalQuery
	// byVM holds the queries of the VMs that data.settings.vms names, with
	// their worked-out values; other is every other VM's. other is nil
	// when no rule of the kind could be worked out.
	byVM  map[string]rego.PreparedEvalQuery
	other *rego.PreparedEvalQuery
}

// forVM returns the query that decides for vm.
func (q *kindQueries) forVM(vm string) rego.PreparedEvalQuery {
	if s, ok := q.byVM[vm]; ok {
		return s
	}
	if q.other != nil {
		return *q.other
	}
	return q.generic
}

var (
	inputVMRef     = ast.MustParseRef("input.vm")
	settingsVMsRef = ast.MustParseRef("data.settings.vms")
)

// specialize prepares kind k's per-VM queries, for the VMs named in
// data.settings.vms (vms) and for all others. values holds the queries
// that work out one rule, which kinds share.
func (p *Policy) specialize(ctx context.Context, k Kind, generic rego.PreparedEvalQuery, vms []string, values map[string]rego.PreparedEvalQuery) *kindQueries {
	q := &kindQueries{generic: generic}
	decision := ast.MustParseRef("data.carrel." + string(k) + ".decision")
	a := &vmAnalysis{c: p.compiler, memo: map[*ast.Rule]bool{}}
	frontier := a.frontier(decision)
	if len(frontier) == 0 {
		return q
	}
	// VMs whose values are the same share a query: preparing one costs
	// about 2 ms, and most overrides leave most kinds alone.
	prepared := map[string]rego.PreparedEvalQuery{}
	prep := func(vm string) (rego.PreparedEvalQuery, error) {
		expr := ast.NewExpr(ast.NewTerm(decision))
		in := ast.NewObject(
			ast.Item(ast.StringTerm("version"), ast.IntNumberTerm(InputVersion)),
			ast.Item(ast.StringTerm("vm"), ast.StringTerm(vm)),
		)
		for _, ref := range frontier {
			v, ok, err := p.valueOf(ctx, values, ref, in)
			if err != nil {
				return rego.PreparedEvalQuery{}, err
			}
			// An undefined value cannot be put in place; OPA works it out.
			if ok {
				expr = expr.IncludeWith(ast.NewTerm(ref), ast.NewTerm(v))
			}
		}
		key := expr.String()
		if pq, ok := prepared[key]; ok {
			return pq, nil
		}
		pq, err := p.prepare(ctx, fmt.Sprintf("%s for VM %q", decision, vm), rego.ParsedQuery(ast.NewBody(expr)))
		if err != nil {
			return pq, err
		}
		prepared[key] = pq
		return pq, nil
	}
	// The generic query prepared, so a specialised one that does not (a
	// case the analysis missed) leaves the kind to the rules as written.
	other, err := prep(unnamedVM(vms))
	if err != nil {
		return q
	}
	q.other = &other
	q.byVM = make(map[string]rego.PreparedEvalQuery, len(vms))
	for _, vm := range vms {
		if q.byVM[vm], err = prep(vm); err != nil {
			return &kindQueries{generic: generic}
		}
	}
	return q
}

// valueOf evaluates the rule at ref for input in. ok is false when it is
// undefined or fails. values holds the prepared queries, by ref.
func (p *Policy) valueOf(ctx context.Context, values map[string]rego.PreparedEvalQuery, ref ast.Ref, in ast.Value) (ast.Value, bool, error) {
	q, ok := values[ref.String()]
	if !ok {
		var err error
		if q, err = p.prepare(ctx, ref.String(), rego.ParsedQuery(ast.NewBody(ast.NewExpr(ast.NewTerm(ref))))); err != nil {
			return nil, false, err
		}
		values[ref.String()] = q
	}
	// A rule that fails (a conflict, a type error) or runs past the
	// decision timeout here would fail the same way in every decision:
	// it is left in the query, to fail there, and deny, as written.
	ctx, cancel := context.WithTimeout(ctx, EvalTimeout)
	defer cancel()
	rs, err := q.Eval(ctx, rego.EvalParsedInput(in), rego.EvalGenerateJSON(astResult))
	if err != nil || len(rs) != 1 || len(rs[0].Expressions) != 1 {
		return nil, false, nil
	}
	v, ok := rs[0].Expressions[0].Value.(ast.Value)
	return v, ok, nil
}

// settingsVMs lists the keys of data.settings.vms, sorted.
func settingsVMs(data map[string]any) []string {
	settings, _ := data["settings"].(map[string]any)
	vms, _ := settings["vms"].(map[string]any)
	names := make([]string, 0, len(vms))
	for name := range vms {
		names = append(names, name)
	}
	slices.Sort(names)
	return names
}

// unnamedVM is a VM name that vms does not hold: "" unless it does.
func unnamedVM(vms []string) string {
	name := ""
	for slices.Contains(vms, name) {
		name += "-"
	}
	return name
}

// vmAnalysis finds the rules whose value depends on data and
// data.settings.vms[input.vm] alone.
type vmAnalysis struct {
	c    *ast.Compiler
	memo map[*ast.Rule]bool
}

// frontier lists the rules, by path, that the rules at root read and that
// can be worked out per VM, without looking inside them. root itself is
// not one of them.
//
// It is empty when any rule root reads uses `with`: a rule evaluated under
// `with` (input.vm, data.settings or a function replaced) may read a
// worked-out rule, and the value put in place for the whole query would
// hide the replacement.
func (a *vmAnalysis) frontier(root ast.Ref) []ast.Ref {
	var out []ast.Ref
	with := false
	seen := map[*ast.Rule]bool{}
	var visit func(rules []*ast.Rule)
	visit = func(rules []*ast.Rule) {
		for _, r := range rules {
			if seen[r] {
				continue
			}
			seen[r] = true
			ast.WalkExprs(r, func(e *ast.Expr) bool {
				with = with || len(e.With) > 0
				return with
			})
			ast.WalkRefs(r, func(ref ast.Ref) bool {
				if !ref[0].Equal(ast.DefaultRootDocument) {
					return false
				}
				for _, dep := range a.rulesAt(ref) {
					path := dep.Ref()
					if a.constantPath(path, ref) && a.all(a.c.GetRulesExact(path)) {
						if !slices.ContainsFunc(out, func(r ast.Ref) bool { return r.Equal(path) }) {
							out = append(out, path)
						}
						continue
					}
					visit([]*ast.Rule{dep})
				}
				return false
			})
		}
	}
	visit(a.c.GetRulesExact(root))
	if with {
		return nil
	}
	return out
}

// constantPath reports whether the rule at path can be put in place by
// `with` where ref reads it: path is ground, names a rule without
// arguments, and ref reads it or something inside it.
//
// The rules at path must be all that make the document there: `with` can
// replace a virtual document only whole, so no rule may define part of it,
// or one that holds it.
func (a *vmAnalysis) constantPath(path, ref ast.Ref) bool {
	if !path.IsGround() || !ref.HasPrefix(path) {
		return false
	}
	exact := a.c.GetRulesExact(path)
	if len(a.c.GetRulesWithPrefix(path)) != len(exact) || len(a.c.GetRulesForVirtualDocument(path)) != len(exact) {
		return false
	}
	for _, r := range exact {
		if len(r.Head.Args) > 0 {
			return false
		}
	}
	return true
}

// rulesAt is every rule that ref may read.
func (a *vmAnalysis) rulesAt(ref ast.Ref) []*ast.Rule {
	return a.c.GetRulesDynamicWithOpts(ref, ast.RulesOptions{IncludeHiddenModules: true})
}

func (a *vmAnalysis) all(rules []*ast.Rule) bool {
	for _, r := range rules {
		if !a.vmOnly(r) {
			return false
		}
	}
	return len(rules) > 0
}

// vmOnly reports whether rule r, its else branches and every rule it
// reads depend on data and data.settings.vms[input.vm] alone.
//
// The compiler rewrites data.settings.vms[input.vm] into
// `__localN__ = input.vm` and data.settings.vms[__localN__]; so r may read
// input only in such an assignment, and use the variable only as that key.
// It may not use `with`, which could replace input or data.
func (a *vmAnalysis) vmOnly(r *ast.Rule) bool {
	if v, ok := a.memo[r]; ok {
		return v
	}
	a.memo[r] = false // the compiler refuses recursion; this ends a cycle all the same
	vmVars := ast.NewVarSet()
	ast.WalkExprs(r, func(e *ast.Expr) bool {
		if v, ok := vmAssignment(e); ok {
			vmVars.Add(v)
		}
		return false
	})
	ok := true
	var check func(x any)
	check = func(x any) {
		ast.NewGenericVisitor(func(x any) bool {
			if !ok {
				return true
			}
			switch x := x.(type) {
			case *ast.Expr:
				if len(x.With) > 0 {
					ok = false
				}
				if _, assign := vmAssignment(x); assign {
					return true
				}
			case ast.Var:
				if vmVars.Contains(x) || x.Equal(ast.InputRootDocument.Value) {
					ok = false
				}
			case ast.Ref:
				switch {
				case x[0].Equal(ast.InputRootDocument):
					ok = false
				case len(x) > 3 && x.HasPrefix(settingsVMsRef) && isVar(x[3], vmVars) &&
					len(a.rulesAt(x[:3])) == 0 && len(a.rulesAt(x)) == 0:
					for _, t := range x[4:] {
						check(t)
					}
					return true
				case x[0].Equal(ast.DefaultRootDocument):
					for _, dep := range a.rulesAt(x) {
						if !a.vmOnly(dep) {
							ok = false
						}
					}
				}
			}
			return !ok
		}).Walk(x)
	}
	check(r)
	a.memo[r] = ok
	return ok
}

// vmAssignment reports whether e is `v = input.vm` (either way round),
// and v.
func vmAssignment(e *ast.Expr) (ast.Var, bool) {
	if !e.IsEquality() || len(e.With) > 0 || e.Negated {
		return "", false
	}
	l, r := e.Operand(0), e.Operand(1)
	if v, ok := l.Value.(ast.Var); ok && inputVMRef.Equal(r.Value) {
		return v, true
	}
	if v, ok := r.Value.(ast.Var); ok && inputVMRef.Equal(l.Value) {
		return v, true
	}
	return "", false
}

func isVar(t *ast.Term, vars ast.VarSet) bool {
	v, ok := t.Value.(ast.Var)
	return ok && vars.Contains(v)
}
