package policy

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/open-policy-agent/opa/v1/ast"
	"github.com/open-policy-agent/opa/v1/rego"
)

// overridesData is the default data with overrides for VM "build", to
// which each kind's settings differ.
const overridesData = `{"settings": {
  "api": {"operator_uids": [], "operator_gids": [], "operator_groups": ["carrel"],
    "token_classes": ["read", "exec", "files_read", "files_write", "ports", "audit"],
    "key_classes": ["read", "exec", "files_read", "files_write", "ports", "audit", "snapshot"]},
  "exec": {"users": ["agent"], "allow_root": false, "denied_commands": []},
  "fs": {"read_write": ["/workspace", "/home/agent", "/tmp"],
    "read_only": ["/usr", "/bin", "/etc", "/proc"],
    "secret_paths": ["/etc/shadow", "/root", "/workspace/.git/config"],
    "secret_names": [".ssh", ".env"]},
  "net": {"allow_forward": true, "egress_allow": [], "limits": {}},
  "guest": {"allowed_requests": []},
  "gpu": {"allowed_vms": [], "devices": ["*"]},
  "vms": {
    "build": {
      "exec": {"users": ["agent", "bob", "root"], "allow_root": true, "denied_commands": ["curl", "wg+"]},
      "fs": {"read_write": ["/", "/srv/a+b", "/workspace"], "secret_names": []},
      "net": {"allow_forward": false, "egress_allow": [{"host": "*.npmjs.org", "port": 443}]},
      "api": {"token_classes": ["read"]},
      "guest": {"allowed_requests": ["checkpoint"]}
    },
    "": {"exec": {"users": ["nobody"]}}
  }
}}`

// decisionInputs are inputs of every kind for each of vms: the common case
// and the edges of every shortcut.
func decisionInputs(vms []string) []Input {
	var ins []Input
	for _, vm := range vms {
		for _, user := range []string{"agent", "bob", "root", "0", "nobody"} {
			for _, argv0 := range []string{"go", "/usr/bin/curl", "curl", "wg+", "wgg", "/usr/bin/", "sh"} {
				for _, cwd := range []string{"/workspace", "/workspace/src", "/workspacex", "/tmp/.ssh", "/tmp/.envrc",
					"/etc", "/root", "/", "/srv/a+b/x", "/srv/aab", "/workspace/.git/config"} {
					ins = append(ins, &ExecInput{Caller: peer(1000), VM: vm, Argv: []string{argv0, "-v"}, Cwd: cwd, User: user})
				}
			}
		}
		for _, op := range []string{OpRead, OpWrite, OpList, OpDelete} {
			for _, path := range []string{"/workspace", "/workspace/src/main.go", "/workspacex/a", "/tmp/x", "/tmp/.ssh/known_hosts",
				"/workspace/.env", "/workspace/.envrc", "/usr/bin/env", "/etc", "/etc/shadow", "/root", "/var/x", "/",
				"/srv/a+b/c", "/srv/aab/c", "/workspace/.git/config"} {
				for _, recursive := range []bool{false, true} {
					ins = append(ins, &FSInput{Caller: peer(1000), VM: vm, Operation: op, Path: path, Recursive: recursive})
				}
			}
		}
		for _, host := range []string{"registry.npmjs.org", "npmjs.org", "10.0.0.1", "example.com"} {
			ins = append(ins,
				&NetInput{VM: vm, Direction: DirEgress, Host: host, Port: 443, Protocol: "tcp"},
				&NetInput{VM: vm, Direction: DirEgress, Host: host, Port: 443, Protocol: "tcp",
					Addresses: []NetAddress{{IP: "10.0.0.1", Class: "private"}}},
			)
		}
		ins = append(ins,
			&NetInput{Caller: token(vm), VM: vm, Direction: DirForward, Host: "localhost", Port: 8080},
			&APIInput{Caller: peer(0), Procedure: "/carrel.api.v1.VMService/CreateVM", VM: vm},
			&APIInput{Caller: token(vm), Procedure: "/carrel.agent.v1.AgentService/Process", VM: vm},
			&APIInput{Caller: token(vm), Procedure: "/carrel.api.v1.VMService/GetVM", VM: vm},
			&GuestInput{VM: vm, Request: "checkpoint"},
		)
	}
	return ins
}

// asWritten is p deciding with every rule evaluated as written.
func asWritten(p *Policy) *Policy {
	w := *p
	w.asWritten = true
	w.cache = newDecisionCache(decisionCacheSize)
	return &w
}

// TestSpecializedDecisionsMatchTheRules compares, for every bundle carrel
// ships and for one with per-VM overrides, each decision made with the
// settings worked out at compile time against the rules as written.
func TestSpecializedDecisionsMatchTheRules(t *testing.T) {
	bundles := map[string]map[string][]byte{}
	for _, name := range BuiltinNames() {
		b, err := Builtin(name)
		if err != nil {
			t.Fatal(err)
		}
		bundles[name] = b.Files
	}
	files := defaultFiles(t)
	files[DataFile] = []byte(overridesData)
	bundles["overrides"] = files
	for name, files := range bundles {
		t.Run(name, func(t *testing.T) {
			p, seen := decideAlike(t, files, decisionInputs([]string{"demo", "build", "", "other"})...)
			for _, k := range []Kind{KindExec, KindFS, KindNet} {
				if p.decide[k].other == nil {
					t.Errorf("kind %s: nothing was worked out at compile time", k)
				}
			}
			if name == "overrides" && len(p.decide[KindExec].byVM) != 2 {
				t.Errorf("exec values by VM: %d, want 2", len(p.decide[KindExec].byVM))
			}
			for _, k := range []Kind{KindExec, KindFS, KindNet} {
				if n := workedReads(t, p, benchInputs[k]()); n == 0 {
					t.Errorf("kind %s: no worked-out value was read in a common decision", k)
				}
			}
			// The inputs reach many rules, not one.
			if len(seen) < 10 {
				t.Errorf("the inputs reached only %d rules: %v", len(seen), seen)
			}
		})
	}
}

// workedReads evaluates in with p and returns how many reads the
// worked-out values answered.
func workedReads(t *testing.T, p *Policy, in Input) int {
	t.Helper()
	n := -1
	q := *p
	q.workedHits = func(hits int) { n = hits }
	if _, err := q.Evaluate(context.Background(), in); err != nil {
		t.Fatalf("%s: %v", in.Kind(), err)
	}
	if n < 0 {
		return 0
	}
	return n
}

// specializable bundles a rule p into package carrel.exec, which its
// decision reads, and returns whether Compile worked p out per VM.
func specializable(t *testing.T, rules string) bool {
	t.Helper()
	b, err := tinyBundle(t, func(m map[string]string) {
		m["exec.rego"] = "package carrel.exec\n\n" +
			`decision := {"allow": false, "rule": "carrel.exec.default_deny", "reason": "tiny"} if p` + "\n\n" +
			`decision := {"allow": true, "rule": "carrel.exec.tiny", "reason": "tiny"} if not p` + "\n\n" + rules
	})
	if err != nil {
		t.Fatal(err)
	}
	p, err := Compile(context.Background(), "tiny", b)
	if err != nil {
		t.Fatalf("%s: %v", rules, err)
	}
	a := &vmAnalysis{c: p.compiler, memo: map[*ast.Rule]bool{}}
	return slices.ContainsFunc(a.frontier(ast.MustParseRef("data.carrel.exec.decision")), func(r ast.Ref) bool {
		return r.Equal(ast.MustParseRef("data.carrel.exec.p"))
	})
}

// TestWorkedOutOnlyWhatDependsOnTheVMsSettings: a rule is worked out per
// VM only when it reads data, and input.vm only as the key of
// data.settings.vms.
func TestWorkedOutOnlyWhatDependsOnTheVMsSettings(t *testing.T) {
	for _, c := range []struct {
		rules string
		want  bool
	}{
		{`p := count(data.settings.exec.users) > 0`, true},
		{`p := object.union(data.settings.exec, o) == {} if { o := data.settings.vms[input.vm].exec } else := false`, true},
		{"p := q\n\nq := data.settings.vms[input.vm].exec.allow_root == true", true},
		{"p := f(data.settings.exec.users)\n\nf(x) := count(x) > 1", true},
		{`p := input.user == "root"`, false},
		{`p := startswith(input.vm, "prod-")`, false},
		{`p := data.settings.vms[v] == {} if v := input.vm`, true},
		{`p := data.settings.vms[v] == {} if { v := input.vm; startswith(v, "prod-") }`, false},
		{`p := data.settings.vms[input.user] == {}`, false},
		{`p := count(input) > 0`, false},
		{"p := q\n\nq := input.tty", false},
		{"p := f(1)\n\nf(x) := x == input.tty", false},
		{`p if { data.settings.exec.users == [] with input as {} }`, false},
		{"p if { q with data.settings.exec.users as [] }\n\nq := data.settings.exec.users == []", false},
		{"p := count(data.settings.vms[input.vm].exec[input.user]) > 0", false},
	} {
		t.Run(strings.SplitN(c.rules, "\n", 2)[0], func(t *testing.T) {
			if got := specializable(t, c.rules); got != c.want {
				t.Errorf("worked out at compile time: %v, want %v", got, c.want)
			}
		})
	}
}

// TestPatternsOfManyVMsStayCompiled: each VM with its own settings has
// patterns of its own, and the policy keeps them compiled, beyond the 100
// of OPA's process-wide cache.
func TestPatternsOfManyVMsStayCompiled(t *testing.T) {
	ctx := context.Background()
	const n = 150
	vms := make([]string, n)
	for i := range vms {
		vms[i] = fmt.Sprintf(`"vm%d": {"fs": {"read_write": ["/w%d"]}}`, i, i)
	}
	files := defaultFiles(t)
	files[DataFile] = []byte(strings.Replace(string(files[DataFile]), `"vms": {}`, `"vms": {`+strings.Join(vms, ", ")+`}`, 1))
	p := compileFiles(t, files)
	if len(p.decide[KindFS].byVM) != n {
		t.Fatalf("fs values for %d VMs, want %d", len(p.decide[KindFS].byVM), n)
	}
	for round := range 2 {
		for i := range n {
			vm := fmt.Sprintf("vm%d", i)
			d, err := p.Evaluate(ctx, &FSInput{Caller: peer(1000), VM: vm, Operation: OpWrite, Path: fmt.Sprintf("/w%d/x", i)})
			want := fmt.Sprintf("write /w%d/x: under read-write root /w%d", i, i)
			if err != nil || !d.Allow || d.Reason != want {
				t.Fatalf("round %d, %s: %+v, %v", round, vm, d, err)
			}
		}
	}
	in := ast.NewObject(ast.Item(ast.StringTerm("vm"), ast.StringTerm("vm7")))
	pattern, ok, err := p.valueOf(ctx, map[string]rego.PreparedEvalQuery{}, ast.MustParseRef("data.carrel.fs.quick_pattern"), in)
	if err != nil || !ok {
		t.Fatalf("quick_pattern: %v, %v", ok, err)
	}
	if _, ok := p.patterns.Get(pattern); !ok {
		t.Errorf("%v is not in the policy's pattern cache", pattern)
	}
}

// TestSettingsThatFailStillFailEachDecision: an override that makes the
// settings rule fail does not stop the bundle compiling; that VM's
// decisions fail and deny, as the rules as written do, and other VMs
// decide as usual.
func TestSettingsThatFailStillFailEachDecision(t *testing.T) {
	ctx := context.Background()
	files := defaultFiles(t)
	files[DataFile] = []byte(strings.Replace(string(files[DataFile]), `"vms": {}`, `"vms": {"bad": {"exec": "not an object"}}`, 1))
	p := compileFiles(t, files)
	w := asWritten(p)
	for _, vm := range []string{"bad", "demo"} {
		in := &ExecInput{Caller: peer(1000), VM: vm, Argv: []string{"ls"}, Cwd: "/workspace", User: "agent"}
		got, err1 := p.Evaluate(ctx, in)
		want, err2 := w.Evaluate(ctx, in)
		if (err1 == nil) != (err2 == nil) || got.Allow != want.Allow || got.Rule != want.Rule {
			t.Fatalf("%s: worked out %v %s (%v); as written %v %s (%v)", vm, got.Allow, got.Rule, err1, want.Allow, want.Rule, err2)
		}
		if vm == "bad" && (err1 == nil || got.Allow || got.Rule != "carrel.eval_error") {
			t.Fatalf("bad: %v %s (%v), want a failed evaluation that denies", got.Allow, got.Rule, err1)
		}
		if vm == "demo" && (err1 != nil || !got.Allow) {
			t.Fatalf("demo: %v %s (%v), want an allow", got.Allow, got.Rule, err1)
		}
	}
}

// compileFiles compiles a bundle of files.
func compileFiles(t *testing.T, files map[string][]byte) *Policy {
	t.Helper()
	b, err := NewBundle(files)
	if err != nil {
		t.Fatal(err)
	}
	p, err := Compile(context.Background(), "test", b)
	if err != nil {
		t.Fatalf("Compile: %v", err)
	}
	return p
}

// decideAlike compiles files, checks that each input is decided the same
// with the worked-out values as by the rules as written, and returns the
// policy and how many inputs each rule decided.
func decideAlike(t *testing.T, files map[string][]byte, ins ...Input) (*Policy, map[string]int) {
	t.Helper()
	ctx := context.Background()
	p := compileFiles(t, files)
	w := asWritten(p)
	seen := map[string]int{}
	for _, in := range ins {
		got, err1 := p.Evaluate(ctx, in)
		want, err2 := w.Evaluate(ctx, in)
		if got.Allow != want.Allow || got.Rule != want.Rule || got.Reason != want.Reason || fmt.Sprint(err1) != fmt.Sprint(err2) {
			t.Fatalf("%s %s: worked out %v %s %q (%v); as written %v %s %q (%v)", in.Kind(), got.Input,
				got.Allow, got.Rule, got.Reason, err1, want.Allow, want.Rule, want.Reason, err2)
		}
		seen[got.Rule]++
	}
	return p, seen
}

// TestWithSeesTheRulesAsWritten: a rule that evaluates part of a decision
// under `with` may read a worked-out rule under another VM's name or
// settings. There the worked-out values are hidden and the rule is
// evaluated as written, while the rest of the decision still uses them.
func TestWithSeesTheRulesAsWritten(t *testing.T) {
	first := "decision := {\n\t\"allow\": true,\n\t\"rule\": \"carrel.exec.user\",\n\t\"reason\": reason,\n} if {\n"
	for name, branch := range map[string]string{
		"input.vm": `decision := {"allow": true, "rule": "carrel.exec.as_build", "reason": "as on build"} if {
	"bob" in settings.users with input.vm as "build"
} else := `,
		"data.settings": `decision := {"allow": false, "rule": "carrel.exec.not_default", "reason": "not a default user"} if {
	not input.user in settings.users with data.settings.vms as {}
} else := `,
	} {
		t.Run(name, func(t *testing.T) {
			files := defaultFiles(t)
			files[DataFile] = []byte(strings.Replace(string(files[DataFile]), `"vms": {}`,
				`"vms": {"build": {"exec": {"users": ["agent", "bob"]}}, "demo": {"exec": {"users": ["agent", "bob"]}}}`, 1))
			src := string(files["exec.rego"])
			if !strings.Contains(src, first) {
				t.Fatal("exec.rego's first branch has changed; update the test")
			}
			files["exec.rego"] = []byte(strings.Replace(src, first, branch+strings.TrimPrefix(first, "decision := "), 1))
			var ins []Input
			for _, vm := range []string{"demo", "build", "other"} {
				ins = append(ins, &ExecInput{Caller: peer(1000), VM: vm, Argv: []string{"ls"}, Cwd: "/workspace", User: "bob"})
			}
			p, _ := decideAlike(t, files, ins...)
			if p.decide[KindExec].other == nil || p.decide[KindExec].forVM("demo").get(ast.MustParseRef("data.carrel.exec.settings")) == nil {
				t.Error("exec's settings were not worked out at compile time")
			}
			// User agent is not bob: the branch under `with` fails, and the
			// decision goes on to the worked-out values, which are seen
			// again once the `with` is over.
			agent := &ExecInput{Caller: peer(1000), VM: "demo", Argv: []string{"ls"}, Cwd: "/workspace", User: "agent"}
			decideAlike(t, files, agent)
			if name == "data.settings" && workedReads(t, p, agent) == 0 {
				t.Error("after the branch under `with`, no worked-out value was read")
			}
		})
	}
}

// TestPartlyDefinedDocumentsAreNotReplaced: OPA keeps a virtual
// document's value by its path, whole; a rule beside one that defines part
// of the same document, or may by a variable key, is left to OPA, and the
// bundle still compiles.
func TestPartlyDefinedDocumentsAreNotReplaced(t *testing.T) {
	b, err := tinyBundle(t, func(m map[string]string) {
		m["exec.rego"] = "package carrel.exec\n\n" +
			`default decision := {"allow": false, "rule": "carrel.exec.default_deny", "reason": "tiny"}` + "\n\n" +
			`decision := {"allow": true, "rule": "carrel.exec.open", "reason": "tiny"} if t.mode == "open"` + "\n\n" +
			"t.mode := \"closed\"\n\n" +
			"t[k] := v if { some k, v in input.env }\n"
	})
	if err != nil {
		t.Fatal(err)
	}
	decideAlike(t, b.Files,
		&ExecInput{Caller: peer(1000), VM: "demo", Argv: []string{"ls"}, Env: map[string]string{"mode": "open"}},
		&ExecInput{Caller: peer(1000), VM: "demo", Argv: []string{"ls"}, Env: map[string]string{"x": "open"}},
	)
}

// TestRulesNamedByAnyTermAreWorkedOut: a rule's path may end in a number
// or another ground term, not only a name.
func TestRulesNamedByAnyTermAreWorkedOut(t *testing.T) {
	b, err := tinyBundle(t, func(m map[string]string) {
		m["exec.rego"] = "package carrel.exec\n\n" +
			`default decision := {"allow": false, "rule": "carrel.exec.default_deny", "reason": "tiny"}` + "\n\n" +
			`decision := {"allow": true, "rule": "carrel.exec.port", "reason": r} if r := ports[443]` + "\n\n" +
			"ports[443] := concat(\" \", data.settings.exec.users)\n\n" +
			"ports[true] := \"t\"\n"
		m[DataFile] = `{"settings": {"exec": {"users": ["agent", "bob"]}}}`
	})
	if err != nil {
		t.Fatal(err)
	}
	in := &ExecInput{Caller: peer(1000), VM: "demo", Argv: []string{"ls"}}
	p, _ := decideAlike(t, b.Files, in)
	if workedReads(t, p, in) == 0 {
		t.Error("ports[443] was not read from the worked-out values")
	}
}

// TestClockBuiltinsAreRefused: builtins that check certificates or tokens
// against the current time make a decision depend on when it is made;
// like time.now_ns, a bundle may not use them.
func TestClockBuiltinsAreRefused(t *testing.T) {
	for _, call := range []string{
		`crypto.x509.parse_and_verify_certificates(data.settings.ca)[0]`,
		`crypto.x509.parse_and_verify_certificates_with_options(data.settings.ca, {})[0]`,
		`io.jwt.decode_verify(input.env.TOKEN, {"secret": "s"})[0]`,
		`time.now_ns() > 0`,
	} {
		b, err := tinyBundle(t, func(m map[string]string) {
			m["exec.rego"] += "\nvalid if " + call + "\n"
		})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := Compile(context.Background(), "clock", b); !errors.Is(err, ErrInvalidBundle) {
			t.Errorf("%s: Compile = %v, want ErrInvalidBundle", call, err)
		}
	}
}
