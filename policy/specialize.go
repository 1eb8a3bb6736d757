package policy

// Per-VM settings, worked out at compile time.
//
// Much of what a decision reads depends on the bundle's data and the VM's
// name alone: a VM's settings (data.settings.<kind>, with its overrides
// from data.settings.vms merged over them) and tables derived from them.
// OPA works such rules out again on every evaluation. Compile works them
// out once instead: once for each VM that data.settings.vms names, and
// once for every other VM. An evaluation for that VM starts with those
// values already in OPA's cache of rule values (its virtual cache), as if
// the evaluation had just worked them out itself, so it runs only the
// rules that read the rest of its input.
//
// A value in that cache is the rule's own value, not a replacement: a
// rule is worked out only when Compile can show that its value cannot
// depend on anything else: the rules it reads, transitively, read input
// only as input.vm, and use input.vm only as the key in
// data.settings.vms[input.vm], so that every VM that data.settings.vms
// does not name sees the same value. Any other rule is left to OPA, as
// written. Under `with`, OPA starts a fresh frame of the cache, in which
// the worked-out values are not seen (vmCache), so a rule evaluated with
// another input.vm, other settings or a function replaced is evaluated as
// written.
// The rules stay the source of truth: Rego tests that override
// data.settings with `with` evaluate them as written, and a decision made
// with the worked-out values is the decision the rules give (the engine's
// tests check this on every bundle carrel ships).
//
// This replaced a query per VM with the values put in place by `with`:
// OPA merges a query's `with` values into a new data tree on every
// evaluation, which cost about a sixth of an exec decision.

import (
	"context"
	"slices"

	"github.com/open-policy-agent/opa/v1/ast"
	"github.com/open-policy-agent/opa/v1/rego"
	"github.com/open-policy-agent/opa/v1/topdown"
)

// kindQueries are one kind's prepared decision query and the values
// worked out for it per VM.
type kindQueries struct {
	// generic evaluates every rule as written.
	generic rego.PreparedEvalQuery
	// byVM holds the worked-out values of the VMs that data.settings.vms
	// names; other is every other VM's. other is nil when no rule of the
	// kind could be worked out.
	byVM  map[string]*workedOut
	other *workedOut
}

// forVM returns the values worked out for vm, or nil if none are.
func (q *kindQueries) forVM(vm string) *workedOut {
	if w, ok := q.byVM[vm]; ok {
		return w
	}
	return q.other
}

// workedOut is one VM's worked-out rule values, by the rule's path. It is
// filled at compile time and only read after, by any number of
// evaluations at once.
type workedOut struct {
	// byLast holds the values by the hash of the last term of the rule's
	// path (a name, mostly, but any ground term): an evaluation asks for
	// the value of every rule it reads, most of them not worked out, and
	// one map lookup answers that.
	byLast map[int][]workedValue
}

type workedValue struct {
	path  ast.Ref
	value *ast.Term
}

func (w *workedOut) put(path ast.Ref, v ast.Value) {
	h := path[len(path)-1].Value.Hash()
	w.byLast[h] = append(w.byLast[h], workedValue{path, ast.NewTerm(v)})
}

func (w *workedOut) get(ref ast.Ref) *ast.Term {
	if len(ref) == 0 {
		return nil
	}
	for _, v := range w.byLast[ref[len(ref)-1].Value.Hash()] {
		if v.path.Equal(ref) {
			return v.value
		}
	}
	return nil
}

// cache returns a virtual cache for one evaluation that starts with w's
// values.
func (w *workedOut) cache() *vmCache {
	return &vmCache{worked: w, own: topdown.NewVirtualCache()}
}

// vmCache is OPA's virtual cache for one evaluation, with a VM's
// worked-out values seen beneath it in its first frame. OPA pushes a frame
// for each `with`; there the worked-out values are hidden, since `with`
// may change what a rule's value is.
type vmCache struct {
	worked *workedOut
	own    topdown.VirtualCache
	depth  int
	// hits counts the reads that worked-out values answered.
	hits int
}

func (c *vmCache) Push() { c.depth++; c.own.Push() }
func (c *vmCache) Pop()  { c.depth--; c.own.Pop() }

func (c *vmCache) Get(ref ast.Ref) (*ast.Term, bool) {
	if c.depth == 0 {
		if v := c.worked.get(ref); v != nil {
			c.hits++
			return v, false
		}
	}
	return c.own.Get(ref)
}

func (c *vmCache) Put(ref ast.Ref, value *ast.Term) { c.own.Put(ref, value) }

func (c *vmCache) Keys() []ast.Ref {
	keys := c.own.Keys()
	if c.depth == 0 {
		for _, vs := range c.worked.byLast {
			for _, v := range vs {
				keys = append(keys, v.path)
			}
		}
	}
	return keys
}

var (
	inputVMRef     = ast.MustParseRef("input.vm")
	settingsVMsRef = ast.MustParseRef("data.settings.vms")
)

// specialize works out kind k's values per VM, for the VMs named in
// data.settings.vms (vms) and for all others. values holds the queries
// that work out one rule, which kinds share. A query that does not
// prepare (a case the analysis missed) leaves the kind to the rules as
// written.
func (p *Policy) specialize(ctx context.Context, k Kind, generic rego.PreparedEvalQuery, vms []string, values map[string]rego.PreparedEvalQuery) *kindQueries {
	q := &kindQueries{generic: generic}
	a := &vmAnalysis{c: p.compiler, memo: map[*ast.Rule]bool{}}
	frontier := a.frontier(ast.MustParseRef("data.carrel." + string(k) + ".decision"))
	if len(frontier) == 0 {
		return q
	}
	// work returns nil when none of vm's values is defined.
	work := func(vm string) (*workedOut, error) {
		in := ast.NewObject(
			ast.Item(ast.StringTerm("version"), ast.IntNumberTerm(InputVersion)),
			ast.Item(ast.StringTerm("vm"), ast.StringTerm(vm)),
		)
		w := &workedOut{byLast: map[int][]workedValue{}}
		for _, ref := range frontier {
			v, ok, err := p.valueOf(ctx, values, ref, in)
			if err != nil {
				return nil, err
			}
			// An undefined value is left to OPA, as is one that fails.
			if ok {
				w.put(ref, v)
			}
		}
		if len(w.byLast) == 0 {
			return nil, nil
		}
		return w, nil
	}
	other, err := work(unnamedVM(vms))
	if err != nil {
		return q
	}
	byVM := make(map[string]*workedOut, len(vms))
	for _, vm := range vms {
		if byVM[vm], err = work(vm); err != nil {
			return q
		}
	}
	q.other, q.byVM = other, byVM
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
	// it is left to OPA, to fail there, and deny, as written.
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
func (a *vmAnalysis) frontier(root ast.Ref) []ast.Ref {
	var out []ast.Ref
	seen := map[*ast.Rule]bool{}
	var visit func(rules []*ast.Rule)
	visit = func(rules []*ast.Rule) {
		for _, r := range rules {
			if seen[r] {
				continue
			}
			seen[r] = true
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
	return out
}

// constantPath reports whether the value of the rule at path can be
// worked out once where ref reads it: path is ground, names a rule without
// arguments, and ref reads it or something inside it.
//
// The rules at path must be all that make the document there: OPA keeps a
// virtual document's value in its cache by path, whole, so no rule may
// define part of it, or one that holds it, or one whose key, a variable,
// may be its name (`t[k] := v` beside `t.mode := 1`: OPA evaluates both
// for t.mode, and the two may conflict).
func (a *vmAnalysis) constantPath(path, ref ast.Ref) bool {
	if !path.IsGround() || !ref.HasPrefix(path) {
		return false
	}
	exact := a.c.GetRulesExact(path)
	if len(a.c.GetRulesWithPrefix(path)) != len(exact) || len(a.c.GetRulesForVirtualDocument(path)) != len(exact) ||
		len(a.rulesAt(path)) != len(exact) {
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
