// Package policy is carrel's policy engine: OPA/Rego bundles that decide
// every API call, exec, file operation, network connection and guest
// request.
//
// A Bundle is compiled once, in strict mode, into a Policy whose queries
// are prepared; Decide then evaluates one typed, normalised input without
// compiling anything. What a decision reads that depends on the data and
// the VM's settings alone is worked out at compile time, once per VM
// (specialize.go), and each of that VM's evaluations starts with it. An
// undefined or malformed result is a deny, never an error that lets a
// call through. The default bundle lives in
// policy/bundle and the examples in policy/examples; both are embedded.
package policy

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/open-policy-agent/opa/v1/ast"
	"github.com/open-policy-agent/opa/v1/metrics"
	"github.com/open-policy-agent/opa/v1/rego"
	"github.com/open-policy-agent/opa/v1/storage"
	"github.com/open-policy-agent/opa/v1/storage/inmem"
	"github.com/open-policy-agent/opa/v1/topdown"
	"github.com/open-policy-agent/opa/v1/topdown/cache"
)

// patternCacheSize bounds the compiled regular expressions a policy keeps.
const patternCacheSize = 4096

// EvalTimeout bounds one decision. The default bundle decides in
// microseconds; a rule that loops is cut off and the call denied.
const EvalTimeout = 250 * time.Millisecond

// A Policy is a compiled bundle, safe for concurrent use.
type Policy struct {
	Name     string
	Revision string

	compiler *ast.Compiler
	store    storage.Store
	bundle   *Bundle
	decide   map[Kind]*kindQueries
	sandbox  rego.PreparedEvalQuery
	// limits is data.carrel.net.limits, prepared when the bundle has it.
	limits *rego.PreparedEvalQuery
	cache  *decisionCache
	// patterns holds the regular expressions the rules have compiled.
	// OPA's own cache, shared by the process, keeps only 100, and each VM
	// with its own settings has patterns of its own.
	patterns cache.InterQueryValueCache
	// asWritten makes every decision evaluate the rules as written, with
	// nothing worked out at compile time; tests compare the two.
	asWritten bool
	// workedHits, when set, is told after each evaluation how many reads
	// the worked-out values answered; tests check they are used.
	workedHits func(int)
}

// Decision is the outcome of one evaluation, as it is recorded.
type Decision struct {
	ID          string    `json:"id"`
	Time        time.Time `json:"time"`
	Kind        Kind      `json:"kind"`
	VM          string    `json:"vm,omitempty"`
	Policy      string    `json:"policy"`
	Revision    string    `json:"revision"`
	InputDigest string    `json:"input_digest"`
	Allow       bool      `json:"allow"`
	Rule        string    `json:"rule"`
	Reason      string    `json:"reason"`
	// Cached is true when an earlier evaluation of the same input under
	// the same revision gave the outcome.
	Cached bool `json:"cached,omitempty"`
	// Input is the input's canonical JSON, which InputDigest hashes; the
	// audit log keeps it beside the decision.
	Input json.RawMessage `json:"-"`
}

// Err returns nil for an allow, and for a deny an error naming the rule.
func (d Decision) Err() error {
	if d.Allow {
		return nil
	}
	return &DeniedError{Decision: d}
}

// DeniedError is a deny, as an error.
type DeniedError struct{ Decision Decision }

func (e *DeniedError) Error() string {
	return fmt.Sprintf("denied by policy %s (rule %s): %s [decision %s]", e.Decision.Policy, e.Decision.Rule, e.Decision.Reason, e.Decision.ID)
}

// Compile parses every module in Rego v1, compiles them in strict mode,
// loads the data document, checks that each required rule exists, and
// prepares one query per kind. It runs no tests; see Check.
func Compile(ctx context.Context, name string, b *Bundle) (*Policy, error) {
	modules := map[string]*ast.Module{}
	var data map[string]any
	for p, src := range b.Files {
		if p == DataFile {
			if err := decodeData(src, &data); err != nil {
				return nil, fmt.Errorf("%w: %s: %v", ErrInvalidBundle, p, err)
			}
			continue
		}
		m, err := ast.ParseModuleWithOpts(p, string(src), ast.ParserOptions{RegoVersion: ast.RegoV1})
		if err != nil {
			return nil, fmt.Errorf("%w: %v", ErrInvalidBundle, err)
		}
		modules[p] = m
	}
	if data == nil {
		data = map[string]any{}
	}
	c := ast.NewCompiler().WithStrict(true).WithDefaultRegoVersion(ast.RegoV1).WithCapabilities(deterministic)
	c.Compile(modules)
	if c.Failed() {
		return nil, fmt.Errorf("%w: %v", ErrInvalidBundle, c.Errors)
	}
	p := &Policy{
		Name: name, Revision: b.Revision, compiler: c, bundle: b,
		store:  inmem.NewFromObjectWithOpts(data, inmem.OptReturnASTValuesOnRead(true)),
		decide: map[Kind]*kindQueries{},
		cache:  newDecisionCache(decisionCacheSize),
	}
	size := patternCacheSize
	p.patterns = cache.NewInterQueryValueCache(ctx, &cache.Config{
		InterQueryBuiltinValueCache: cache.InterQueryBuiltinValueCacheConfig{MaxNumEntries: &size},
	})
	vms, values := settingsVMs(data), map[string]rego.PreparedEvalQuery{}
	for _, k := range Kinds {
		ref := "data.carrel." + string(k) + ".decision"
		if !hasRule(c, ref) {
			return nil, fmt.Errorf("%w: no rule %s", ErrInvalidBundle, ref)
		}
		q, err := p.prepare(ctx, ref, rego.Query(ref))
		if err != nil {
			return nil, err
		}
		p.decide[k] = p.specialize(ctx, k, q, vms, values)
	}
	for _, ref := range []string{"data.carrel.fs.sandbox", "data.carrel.api.procedures"} {
		if !hasRule(c, ref) {
			return nil, fmt.Errorf("%w: no rule %s", ErrInvalidBundle, ref)
		}
	}
	q, err := p.prepare(ctx, "data.carrel.fs.sandbox", rego.Query("data.carrel.fs.sandbox"))
	if err != nil {
		return nil, err
	}
	p.sandbox = q
	if hasRule(c, "data.carrel.net.limits") {
		q, err := p.prepare(ctx, "data.carrel.net.limits", rego.Query("data.carrel.net.limits"))
		if err != nil {
			return nil, err
		}
		p.limits = &q
	}
	return p, nil
}

// prepare prepares query (a rego.Query or rego.ParsedQuery) against the
// policy's compiled rules and data; name says which, in an error.
func (p *Policy) prepare(ctx context.Context, name string, query func(*rego.Rego)) (rego.PreparedEvalQuery, error) {
	q, err := rego.New(
		query,
		rego.Compiler(p.compiler),
		rego.Store(p.store),
		rego.StrictBuiltinErrors(true),
	).PrepareForEval(ctx)
	if err != nil {
		return q, fmt.Errorf("%w: prepare %s: %v", ErrInvalidBundle, name, err)
	}
	return q, nil
}

// hasRule reports whether the compiled modules define the rule at ref.
func hasRule(c *ast.Compiler, ref string) bool {
	r, err := ast.ParseRef(ref)
	if err != nil {
		return false
	}
	return len(c.GetRules(r)) > 0
}

// decodeData parses the data document: one JSON object, no duplicate
// nesting deeper than maxDepth.
func decodeData(src []byte, data *map[string]any) error {
	if err := checkJSONDepth(src, maxDataDepth); err != nil {
		return err
	}
	return json.Unmarshal(src, data)
}

// Decide normalises in and evaluates it. A deny is a Decision with Allow
// false, not an error; err is non-nil only for bad input (ErrInvalidInput,
// and the decision is a deny) or a failed evaluation (deny as well).
func (p *Policy) Decide(ctx context.Context, in Input) (Decision, error) {
	return p.decide1(ctx, in, true)
}

// Evaluate is Decide without the cache: the rules run every time.
func (p *Policy) Evaluate(ctx context.Context, in Input) (Decision, error) {
	return p.decide1(ctx, in, false)
}

func (p *Policy) decide1(ctx context.Context, in Input, cached bool) (Decision, error) {
	d := Decision{
		ID:       newID(),
		Time:     time.Now().UTC(),
		Kind:     in.Kind(),
		VM:       in.VMName(),
		Policy:   p.Name,
		Revision: p.Revision,
		Rule:     "carrel.invalid_input",
	}
	if err := in.Normalize(); err != nil {
		d.Reason = err.Error()
		return d, err
	}
	d.Input, d.InputDigest = canonical(in)
	queries, ok := p.decide[in.Kind()]
	if !ok {
		d.Rule, d.Reason = "carrel.unknown_kind", "no query for kind "+string(in.Kind())
		return d, fmt.Errorf("%w: kind %q", ErrInvalidInput, in.Kind())
	}
	key := string(in.Kind()) + " " + d.InputDigest
	if o, ok := p.cache.get(key); ok && cached {
		d.Allow, d.Rule, d.Reason, d.Cached = o.allow, o.rule, o.reason, true
		return d, nil
	}
	if err := ctx.Err(); err != nil {
		d.Rule, d.Reason = "carrel.eval_error", "not evaluated: "+err.Error()
		return d, fmt.Errorf("evaluate %s policy %s: %w", in.Kind(), p.Name, err)
	}
	// The deadline, EvalTimeout or the caller's if sooner, is a flag that
	// a timer raises. A context with a timeout, watched by Eval, does the
	// same at several times the cost of a whole small decision. A caller
	// that cancels without a deadline is seen above, before evaluation.
	timeout := EvalTimeout
	if dl, ok := ctx.Deadline(); ok {
		timeout = min(timeout, time.Until(dl))
	}
	halt := topdown.NewCancel()
	opts := make([]rego.EvalOption, 0, 6)
	opts = append(opts, rego.EvalParsedInput(in.value()), rego.EvalExternalCancel(halt),
		rego.EvalMetrics(noMetrics), rego.EvalGenerateJSON(astResult), rego.EvalInterQueryBuiltinValueCache(p.patterns))
	var vc *vmCache
	if w := queries.forVM(d.VM); w != nil && !p.asWritten {
		vc = w.cache()
		opts = append(opts, rego.EvalVirtualCache(vc))
	}
	timer := time.AfterFunc(timeout, halt.Cancel)
	rs, err := queries.generic.Eval(ctx, opts...)
	timer.Stop()
	if p.workedHits != nil && vc != nil {
		p.workedHits(vc.hits)
	}
	if err != nil {
		d.Rule, d.Reason = "carrel.eval_error", "evaluation failed: "+err.Error()
		return d, fmt.Errorf("evaluate %s policy %s: %w", in.Kind(), p.Name, err)
	}
	d.Allow, d.Rule, d.Reason = readDecision(rs, in.Kind())
	p.cache.put(key, outcome{d.Allow, d.Rule, d.Reason})
	return d, nil
}

// deterministic is OPA's capabilities without the builtins it marks
// non-deterministic (http.send, time.now_ns, rand.intn, net.lookup_ip_addr,
// opa.runtime, ...) and those that read the clock although OPA does not
// mark them (clockBuiltins): a decision then depends on its input and the
// bundle alone, so it can be replayed from the record, cached, and what
// depends on settings alone worked out at compile time.
var deterministic = func() *ast.Capabilities {
	caps := ast.CapabilitiesForThisVersion()
	kept := caps.Builtins[:0]
	for _, b := range caps.Builtins {
		if !b.Nondeterministic && !slices.Contains(clockBuiltins, b.Name) {
			kept = append(kept, b)
		}
	}
	caps.Builtins = kept
	return caps
}()

// clockBuiltins check certificates against the current time (the
// _with_options form unless told a CurrentTime), but OPA does not mark
// them non-deterministic as it does io.jwt.decode_verify.
var clockBuiltins = []string{
	"crypto.x509.parse_and_verify_certificates",
	"crypto.x509.parse_and_verify_certificates_with_options",
}

// noMetrics spares each evaluation the metrics Eval would otherwise
// allocate and fill; nothing reads them.
var noMetrics = metrics.NoOp()

// astResult keeps a decision as its AST value, so that readDecision reads
// three fields instead of Eval converting the whole object to Go values.
func astResult(t *ast.Term, _ *rego.EvalContext) (any, error) { return t.Value, nil }

var (
	keyAllow  = ast.StringTerm("allow")
	keyRule   = ast.StringTerm("rule")
	keyReason = ast.StringTerm("reason")
)

// readDecision takes allow, rule and reason from a result set (of AST
// values, see astResult); anything but exactly one well-formed decision
// object is a deny.
func readDecision(rs rego.ResultSet, k Kind) (bool, string, string) {
	undefined := "carrel." + string(k) + ".undefined"
	if len(rs) != 1 || len(rs[0].Expressions) != 1 {
		return false, undefined, "the policy did not decide (undefined result): denied"
	}
	obj, ok := rs[0].Expressions[0].Value.(ast.Object)
	if !ok {
		return false, undefined, "the decision is not an object: denied"
	}
	field := func(key *ast.Term) ast.Value {
		if t := obj.Get(key); t != nil {
			return t.Value
		}
		return nil
	}
	allow, ok := field(keyAllow).(ast.Boolean)
	rule, _ := field(keyRule).(ast.String)
	reason, _ := field(keyReason).(ast.String)
	if !ok {
		return false, undefined, "the decision has no boolean allow: denied"
	}
	if rule == "" {
		rule = ast.String(undefined)
	}
	return bool(allow), string(rule), string(reason)
}

// Sandbox is the part of a VM's fs policy the guest enforces itself.
type Sandbox struct {
	ReadWrite []string `json:"read_write"`
	ReadOnly  []string `json:"read_only"`
	Denied    []string `json:"denied,omitempty"`
}

// Sandbox evaluates data.carrel.fs.sandbox for vm.
func (p *Policy) Sandbox(ctx context.Context, vm string) (Sandbox, error) {
	ctx, cancel := context.WithTimeout(ctx, EvalTimeout)
	defer cancel()
	in := ast.NewObject(
		ast.Item(ast.StringTerm("version"), ast.IntNumberTerm(InputVersion)),
		ast.Item(ast.StringTerm("vm"), ast.StringTerm(vm)),
	)
	rs, err := p.sandbox.Eval(ctx, rego.EvalParsedInput(in))
	if err != nil {
		return Sandbox{}, fmt.Errorf("evaluate the fs sandbox of policy %s: %w", p.Name, err)
	}
	if len(rs) != 1 || len(rs[0].Expressions) != 1 {
		return Sandbox{}, fmt.Errorf("policy %s: data.carrel.fs.sandbox is undefined", p.Name)
	}
	raw, err := json.Marshal(rs[0].Expressions[0].Value)
	if err != nil {
		return Sandbox{}, err
	}
	var s Sandbox
	if err := json.Unmarshal(raw, &s); err != nil {
		return Sandbox{}, fmt.Errorf("policy %s: data.carrel.fs.sandbox: %w", p.Name, err)
	}
	for _, l := range [][]string{s.ReadWrite, s.ReadOnly, s.Denied} {
		for _, path := range l {
			if c, err := CleanPath(path); err != nil || c != path {
				return Sandbox{}, fmt.Errorf("policy %s: sandbox path %q is not absolute and clean", p.Name, path)
			}
		}
	}
	return s, nil
}

// NetLimits are the limits on a VM's egress that carreld enforces besides
// decisions. Zero is no limit.
type NetLimits struct {
	// MaxConnections caps the VM's egress connections open at once.
	MaxConnections int64 `json:"max_connections"`
	// BandwidthBytesPerSecond caps the bytes a second the VM's egress
	// carries each way, over all its connections.
	BandwidthBytesPerSecond int64 `json:"bandwidth_bytes_per_second"`
}

// NetLimits evaluates data.carrel.net.limits for vm. A bundle without the
// rule, or whose rule is undefined for vm, sets no limits; a value that is
// not an object of non-negative integers is an error.
func (p *Policy) NetLimits(ctx context.Context, vm string) (NetLimits, error) {
	if p.limits == nil {
		return NetLimits{}, nil
	}
	ctx, cancel := context.WithTimeout(ctx, EvalTimeout)
	defer cancel()
	in := ast.NewObject(
		ast.Item(ast.StringTerm("version"), ast.IntNumberTerm(InputVersion)),
		ast.Item(ast.StringTerm("vm"), ast.StringTerm(vm)),
		ast.Item(keyDirection, stringTerm(DirEgress)),
	)
	rs, err := p.limits.Eval(ctx, rego.EvalParsedInput(in))
	if err != nil {
		return NetLimits{}, fmt.Errorf("evaluate the net limits of policy %s: %w", p.Name, err)
	}
	if len(rs) != 1 || len(rs[0].Expressions) != 1 {
		return NetLimits{}, nil
	}
	raw, err := json.Marshal(rs[0].Expressions[0].Value)
	if err != nil {
		return NetLimits{}, err
	}
	// Rego numbers come back as floats (1e+06): read them so, and insist
	// on whole, non-negative ones.
	var v struct {
		MaxConnections          float64 `json:"max_connections"`
		BandwidthBytesPerSecond float64 `json:"bandwidth_bytes_per_second"`
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&v); err != nil {
		return NetLimits{}, fmt.Errorf("policy %s: data.carrel.net.limits: %w", p.Name, err)
	}
	for _, f := range []float64{v.MaxConnections, v.BandwidthBytesPerSecond} {
		if f < 0 || f != math.Trunc(f) || f > 1<<53 {
			return NetLimits{}, fmt.Errorf("policy %s: data.carrel.net.limits: %v is not a whole number from 0 to 2^53", p.Name, f)
		}
	}
	return NetLimits{MaxConnections: int64(v.MaxConnections), BandwidthBytesPerSecond: int64(v.BandwidthBytesPerSecond)}, nil
}

// Procedures returns data.carrel.api.procedures: every procedure the api
// package classifies, and its class.
func (p *Policy) Procedures(ctx context.Context) (map[string]string, error) {
	rs, err := rego.New(rego.Query("data.carrel.api.procedures"), rego.Compiler(p.compiler), rego.Store(p.store)).Eval(ctx)
	if err != nil {
		return nil, err
	}
	if len(rs) != 1 || len(rs[0].Expressions) != 1 {
		return nil, errors.New("data.carrel.api.procedures is undefined")
	}
	m, ok := rs[0].Expressions[0].Value.(map[string]any)
	if !ok {
		return nil, errors.New("data.carrel.api.procedures is not an object")
	}
	out := make(map[string]string, len(m))
	for k, v := range m {
		s, _ := v.(string)
		out[k] = s
	}
	return out, nil
}

// Bundle returns the source the policy was compiled from.
func (p *Policy) Bundle() *Bundle { return p.bundle }

// Digest is the sha256 of the input's canonical JSON (object keys sorted,
// as encoding/json writes maps).
func Digest(in Input) string {
	_, digest := canonical(in)
	return digest
}

// canonical returns the input's canonical JSON and its digest.
func canonical(in Input) (json.RawMessage, string) {
	b, err := json.Marshal(in)
	if err != nil {
		return nil, ""
	}
	sum := sha256.Sum256(b)
	return b, "sha256:" + hex.EncodeToString(sum[:])
}

func newID() string {
	var b [12]byte
	rand.Read(b[:])
	return "dec-" + hex.EncodeToString(b[:])
}

// DecodeInput reads an input document of kind from JSON, as `carrel policy
// eval` and the API take it: size and depth capped, unknown fields refused.
func DecodeInput(k Kind, src []byte) (Input, error) {
	in, err := NewInput(k)
	if err != nil {
		return nil, err
	}
	if len(src) > MaxInputBytes {
		return nil, fmt.Errorf("%w: %d bytes, limit %d", ErrInvalidInput, len(src), MaxInputBytes)
	}
	// encoding/json would quietly turn bad bytes into U+FFFD, and the
	// policy would decide on a string nobody sent.
	if !utf8.Valid(src) {
		return nil, fmt.Errorf("%w: the document is not valid UTF-8", ErrInvalidInput)
	}
	if err := checkJSONDepth(src, maxInputDepth); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidInput, err)
	}
	// "version" is accepted (and must be ours) but is not a field.
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(src, &fields); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidInput, err)
	}
	if v, ok := fields["version"]; ok {
		if string(v) != strconv.Itoa(InputVersion) {
			return nil, fmt.Errorf("%w: input version %s, this carreld speaks %d", ErrInvalidInput, v, InputVersion)
		}
		delete(fields, "version")
	}
	stripped, err := json.Marshal(fields)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidInput, err)
	}
	dec := json.NewDecoder(bytes.NewReader(stripped))
	dec.DisallowUnknownFields()
	if err := dec.Decode(in); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidInput, err)
	}
	if err := in.Normalize(); err != nil {
		return nil, err
	}
	return in, nil
}

const (
	maxInputDepth = 8
	maxDataDepth  = 32
)

// checkJSONDepth refuses documents nested deeper than max before any of
// them is decoded into values.
func checkJSONDepth(src []byte, max int) error {
	depth := 0
	inString, escaped := false, false
	for _, c := range src {
		switch {
		case inString:
			switch {
			case escaped:
				escaped = false
			case c == '\\':
				escaped = true
			case c == '"':
				inString = false
			}
		case c == '"':
			inString = true
		case c == '{' || c == '[':
			if depth++; depth > max {
				return fmt.Errorf("nested deeper than %d", max)
			}
		case c == '}' || c == ']':
			depth--
		}
	}
	return nil
}

// KindNames lists the kinds as strings, for flags and messages.
func KindNames() []string {
	names := make([]string, len(Kinds))
	for i, k := range Kinds {
		names[i] = string(k)
	}
	return names
}
