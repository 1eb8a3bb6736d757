package policy

import (
	"context"
	"encoding/json"
	"errors"
	"maps"
	"path"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

var (
	defaultOnce   sync.Once
	defaultPolicy *Policy
	defaultErr    error
)

// compiledDefault compiles the default bundle once for every test, fuzz
// target and benchmark in the package.
func compiledDefault(tb testing.TB) *Policy {
	tb.Helper()
	defaultOnce.Do(func() {
		var b *Bundle
		if b, defaultErr = Builtin(DefaultName); defaultErr == nil {
			defaultPolicy, defaultErr = Compile(context.Background(), DefaultName, b)
		}
	})
	if defaultErr != nil {
		tb.Fatalf("compile the default policy: %v", defaultErr)
	}
	return defaultPolicy
}

func peer(uid uint32) Caller { return Caller{Type: CallerPeer, UID: uid, GID: uid, PID: 4242} }

func token(vm string) Caller { return Caller{Type: CallerToken, TokenID: "tok-1", VM: vm} }

func TestBuiltinsCompileAndPassTheirTests(t *testing.T) {
	names := BuiltinNames()
	if len(names) == 0 || names[0] != DefaultName {
		t.Fatalf("BuiltinNames() = %v, want %q first", names, DefaultName)
	}
	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			b, err := Builtin(name)
			if err != nil {
				t.Fatal(err)
			}
			p, results, err := Check(context.Background(), name, b)
			for _, r := range results {
				if !r.Pass && !r.Skip {
					t.Errorf("rego test %s: %s", r.Name, r.Error)
				}
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(results) == 0 {
				t.Fatal("no rego tests ran")
			}
			if p.Name != name || p.Revision != b.Revision {
				t.Errorf("policy %q revision %q, want %q %q", p.Name, p.Revision, name, b.Revision)
			}
		})
	}
	if _, err := Builtin("no-such-policy"); !errors.Is(err, ErrNoSuchPolicy) {
		t.Errorf("Builtin(no-such-policy) = %v, want ErrNoSuchPolicy", err)
	}
}

func TestDefaultDecisions(t *testing.T) {
	p := compiledDefault(t)
	const (
		createVM = "/carrel.api.v1.VMService/CreateVM"
		execRPC  = "/carrel.api.v1.VMService/Exec"
	)
	cases := []struct {
		name  string
		in    Input
		allow bool
		rule  string
	}{
		{"exec as agent", &ExecInput{Caller: peer(1000), VM: "demo", Argv: []string{"sh", "-c", "ls"}, User: "agent"}, true, "carrel.exec.user"},
		{"exec with defaults", &ExecInput{Caller: peer(1000), VM: "demo", Argv: []string{"/usr/bin/make"}}, true, "carrel.exec.user"},
		{"exec as root", &ExecInput{Caller: peer(0), VM: "demo", Argv: []string{"id"}, User: "root"}, false, "carrel.exec.root_user"},
		{"exec as uid 0", &ExecInput{Caller: peer(0), VM: "demo", Argv: []string{"id"}, User: "0"}, false, "carrel.exec.root_user"},
		{"exec as another user", &ExecInput{Caller: peer(0), VM: "demo", Argv: []string{"id"}, User: "nobody"}, false, "carrel.exec.default_deny"},
		{"exec in a secret cwd", &ExecInput{Caller: peer(0), VM: "demo", Argv: []string{"ls"}, Cwd: "/workspace/.ssh"}, false, "carrel.exec.cwd_denied"},
		{"exec outside every root", &ExecInput{Caller: peer(0), VM: "demo", Argv: []string{"ls"}, Cwd: "/home"}, false, "carrel.exec.cwd_denied"},

		{"fs write in workspace", &FSInput{Caller: peer(1000), VM: "demo", Operation: OpWrite, Path: "/workspace/a.txt"}, true, "carrel.fs.read_write_root"},
		{"fs delete the workspace", &FSInput{Caller: peer(1000), VM: "demo", Operation: OpDelete, Path: "/workspace", Recursive: true}, true, "carrel.fs.read_write_root"},
		{"fs create in tmp", &FSInput{Caller: peer(1000), VM: "demo", Operation: OpCreate, Path: "/tmp/x"}, true, "carrel.fs.read_write_root"},
		{"fs read usr", &FSInput{Caller: peer(1000), VM: "demo", Operation: OpRead, Path: "/usr/bin/env"}, true, "carrel.fs.read_only_root"},
		{"fs write usr", &FSInput{Caller: peer(1000), VM: "demo", Operation: OpWrite, Path: "/usr/bin/env"}, false, "carrel.fs.default_deny"},
		{"fs read shadow", &FSInput{Caller: peer(0), VM: "demo", Operation: OpRead, Path: "/etc/shadow"}, false, "carrel.fs.secret_path"},
		{"fs read shadow by dotdot", &FSInput{Caller: peer(0), VM: "demo", Operation: OpRead, Path: "/workspace/../etc/shadow"}, false, "carrel.fs.secret_path"},
		{"fs read etc recursively", &FSInput{Caller: peer(0), VM: "demo", Operation: OpRead, Path: "/etc", Recursive: true}, false, "carrel.fs.secret_path"},
		{"fs read etc flat", &FSInput{Caller: peer(0), VM: "demo", Operation: OpList, Path: "/etc"}, true, "carrel.fs.read_only_root"},
		{"fs read ssh key in workspace", &FSInput{Caller: peer(1000), VM: "demo", Operation: OpRead, Path: "/workspace/.ssh/id"}, false, "carrel.fs.secret_path"},
		{"fs write .env in workspace", &FSInput{Caller: peer(1000), VM: "demo", Operation: OpWrite, Path: "/workspace/app/.env"}, false, "carrel.fs.secret_path"},
		{"fs write workspacex", &FSInput{Caller: peer(1000), VM: "demo", Operation: OpWrite, Path: "/workspacex"}, false, "carrel.fs.default_deny"},
		{"fs read workspacex", &FSInput{Caller: peer(1000), VM: "demo", Operation: OpRead, Path: "/workspacex/a"}, false, "carrel.fs.default_deny"},
		{"fs read root dir", &FSInput{Caller: peer(1000), VM: "demo", Operation: OpRead, Path: "/root/notes"}, false, "carrel.fs.secret_path"},

		{"net egress", &NetInput{VM: "demo", Direction: DirEgress, Host: "registry.npmjs.org", Port: 443}, false, "carrel.net.default_deny"},
		{"net forward", &NetInput{Caller: peer(1000), VM: "demo", Direction: DirForward, Host: "localhost", Port: 8080}, true, "carrel.net.forward"},

		{"guest checkpoint", &GuestInput{VM: "demo", Request: "checkpoint", Args: map[string]string{"name": "before"}}, false, "carrel.guest.default_deny"},

		{"api root peer", &APIInput{Caller: peer(0), DaemonUID: 0, Procedure: createVM, VM: "a"}, true, "carrel.api.operator"},
		{"api daemon's own uid", &APIInput{Caller: peer(990), DaemonUID: 990, Procedure: createVM, VM: "a"}, true, "carrel.api.operator"},
		{"api other peer", &APIInput{Caller: peer(1000), DaemonUID: 0, Procedure: createVM, VM: "a"}, false, "carrel.api.default_deny"},
		{"api unknown procedure", &APIInput{Caller: peer(0), Procedure: "/carrel.api.v1.VMService/Nope", VM: "a"}, false, "carrel.api.unknown_procedure"},
		{"api token on its vm", &APIInput{Caller: token("a"), Procedure: execRPC, VM: "a"}, true, "carrel.api.token"},
		{"api token on another vm", &APIInput{Caller: token("a"), Procedure: execRPC, VM: "b"}, false, "carrel.api.token_vm"},
		{"api token naming no vm", &APIInput{Caller: token("a"), Procedure: "/carrel.api.v1.VMService/ListVMs"}, false, "carrel.api.token_vm"},
		{"api unscoped token", &APIInput{Caller: token(""), Procedure: execRPC, VM: ""}, false, "carrel.api.token_vm"},
		{"api token creating a vm", &APIInput{Caller: token("a"), Procedure: createVM, VM: "a"}, false, "carrel.api.token_class"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d, err := p.Decide(context.Background(), c.in)
			if err != nil {
				t.Fatalf("Decide: %v", err)
			}
			if d.Allow != c.allow || d.Rule != c.rule {
				t.Errorf("allow %v rule %s (%s), want allow %v rule %s", d.Allow, d.Rule, d.Reason, c.allow, c.rule)
			}
			if d.Reason == "" {
				t.Error("empty reason")
			}
			if (d.Err() == nil) != c.allow {
				t.Errorf("Err() = %v for allow %v", d.Err(), d.Allow)
			}
		})
	}
}

func TestDecisionFields(t *testing.T) {
	p := compiledDefault(t)
	ctx := context.Background()
	mk := func(path string) *FSInput {
		return &FSInput{Caller: peer(1000), VM: "demo", Operation: OpRead, Path: path}
	}
	ids := map[string]bool{}
	var digests []string
	for range 50 {
		d, err := p.Decide(ctx, mk("/workspace/a"))
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(d.ID, "dec-") || ids[d.ID] {
			t.Fatalf("decision id %q is malformed or repeated", d.ID)
		}
		ids[d.ID] = true
		digests = append(digests, d.InputDigest)
		if d.Kind != KindFS || d.VM != "demo" || d.Policy != DefaultName || d.Revision != p.Revision {
			t.Fatalf("decision %+v: wrong kind, vm, policy or revision (want %s)", d, p.Revision)
		}
		if d.Time.IsZero() || time.Since(d.Time) > time.Minute || d.Time.Location() != time.UTC {
			t.Fatalf("decision time %v", d.Time)
		}
	}
	if !strings.HasPrefix(digests[0], "sha256:") || len(digests[0]) != len("sha256:")+64 {
		t.Fatalf("input digest %q", digests[0])
	}
	for _, dg := range digests {
		if dg != digests[0] {
			t.Fatalf("equal inputs gave digests %s and %s", digests[0], dg)
		}
	}
	// The digest is of the normalised input: an unclean spelling of the
	// same path digests the same; another path does not.
	same, _ := p.Decide(ctx, mk("/workspace//./a/"))
	other, _ := p.Decide(ctx, mk("/workspace/b"))
	if same.InputDigest != digests[0] {
		t.Errorf("normalised-equal input digest %s, want %s", same.InputDigest, digests[0])
	}
	if other.InputDigest == digests[0] {
		t.Errorf("different inputs share digest %s", other.InputDigest)
	}
	// Maps digest in key order, whatever order they were built in.
	e1 := &ExecInput{Caller: peer(1), Argv: []string{"ls"}, Env: map[string]string{"A": "1", "B": "2", "C": "3"}}
	e2 := &ExecInput{Caller: peer(1), Argv: []string{"ls"}, Env: map[string]string{"C": "3", "A": "1", "B": "2"}}
	d1, _ := p.Decide(ctx, e1)
	d2, _ := p.Decide(ctx, e2)
	if d1.InputDigest != d2.InputDigest || d1.InputDigest == "" {
		t.Errorf("equal exec inputs digest %q and %q", d1.InputDigest, d2.InputDigest)
	}

	// Another bundle is another revision, and its decisions say so.
	files := defaultFiles(t)
	files["extra.rego"] = []byte("package carrel.extra\n\nx := 1\n")
	b, err := NewBundle(files)
	if err != nil {
		t.Fatal(err)
	}
	if b.Revision == p.Revision {
		t.Fatal("a changed bundle kept its revision")
	}
	p2, err := Compile(ctx, "changed", b)
	if err != nil {
		t.Fatal(err)
	}
	d, err := p2.Decide(ctx, mk("/workspace/a"))
	if err != nil {
		t.Fatal(err)
	}
	if d.Revision != b.Revision || d.Policy != "changed" || d.InputDigest != digests[0] {
		t.Errorf("decision %+v: want revision %s, policy changed, digest %s", d, b.Revision, digests[0])
	}
}

func TestDecideRefusesInvalidInput(t *testing.T) {
	p := compiledDefault(t)
	for _, in := range []Input{
		&ExecInput{Caller: peer(0)},
		&ExecInput{Caller: Caller{Type: "nobody"}, Argv: []string{"ls"}},
		&FSInput{Caller: peer(0), Operation: "rename", Path: "/workspace"},
		&FSInput{Caller: peer(0), Operation: OpRead, Path: "workspace/a"},
		&NetInput{Direction: DirEgress, Host: "example.com", Port: 0},
		&NetInput{Direction: "sideways", Host: "example.com", Port: 1},
		&NetInput{Direction: DirEgress, Host: "exa mple.com", Port: 1},
		&GuestInput{VM: "demo"},
		&APIInput{Caller: peer(0), Procedure: "CreateVM"},
	} {
		d, err := p.Decide(context.Background(), in)
		if !errors.Is(err, ErrInvalidInput) || d.Allow || d.Rule != "carrel.invalid_input" {
			t.Errorf("Decide(%+v) = allow %v rule %s, %v; want a deny with ErrInvalidInput", in, d.Allow, d.Rule, err)
		}
	}
}

func TestSandbox(t *testing.T) {
	p := compiledDefault(t)
	s, err := p.Sandbox(context.Background(), "demo")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(s.ReadWrite, "/workspace") || !slices.Contains(s.ReadOnly, "/usr") {
		t.Errorf("sandbox %+v: want /workspace read-write and /usr read-only", s)
	}
	for _, l := range [][]string{s.ReadWrite, s.ReadOnly, s.Denied} {
		for _, p := range l {
			if !path.IsAbs(p) || path.Clean(p) != p {
				t.Errorf("sandbox path %q is not absolute and clean", p)
			}
		}
	}

	// Per-VM overrides reach the sandbox as they reach decisions.
	var data map[string]any
	if err := json.Unmarshal(defaultFiles(t)[DataFile], &data); err != nil {
		t.Fatal(err)
	}
	data["settings"].(map[string]any)["vms"] = map[string]any{"srv": map[string]any{"fs": map[string]any{"read_write": []string{"/srv"}}}}
	raw, _ := json.Marshal(data)
	b, err := FromFiles(map[string][]byte{DataFile: raw})
	if err != nil {
		t.Fatal(err)
	}
	p2, err := Compile(context.Background(), "srv", b)
	if err != nil {
		t.Fatal(err)
	}
	s, err = p2.Sandbox(context.Background(), "srv")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(s.ReadWrite, []string{"/srv"}) {
		t.Errorf("sandbox of srv: read_write %v, want [/srv]", s.ReadWrite)
	}
	d, err := p2.Decide(context.Background(), &FSInput{Caller: peer(0), VM: "srv", Operation: OpWrite, Path: "/srv/x"})
	if err != nil || !d.Allow {
		t.Errorf("write /srv/x on srv: %+v, %v; want allowed", d, err)
	}
	d, _ = p2.Decide(context.Background(), &FSInput{Caller: peer(0), VM: "srv", Operation: OpWrite, Path: "/workspace/x"})
	if d.Allow {
		t.Errorf("write /workspace/x on srv allowed by %s; its override has no /workspace", d.Rule)
	}
}

func TestProcedures(t *testing.T) {
	procs, err := compiledDefault(t).Procedures(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for name, class := range map[string]string{
		"/carrel.api.v1.VMService/CreateVM":         "admin",
		"/carrel.api.v1.VMService/Exec":             "exec",
		"/carrel.api.v1.VMService/ListVMs":          "read",
		"/carrel.agent.v1.FileService/Write":        "files_write",
		"/carrel.agent.v1.FileService/Read":         "files_read",
		"/carrel.agent.v1.PortService/Connect":      "ports",
		"/carrel.api.v1.ImageService/ListImages":    "read",
		"/carrel.api.v1.VMService/GetConsole":       "read",
		"/carrel.api.v1.VMService/ListAuditRecords": "audit",
		"/carrel.api.v1.SystemService/GetCaller":    "read",
	} {
		if procs[name] != class {
			t.Errorf("procedure %s: class %q, want %q", name, procs[name], class)
		}
	}
	valid := []string{"read", "admin", "exec", "files_read", "files_write", "ports", "snapshot", "audit"}
	for name, class := range procs {
		if !strings.HasPrefix(name, "/") || !slices.Contains(valid, class) {
			t.Errorf("procedure %q has class %q", name, class)
		}
	}
}

// defaultFiles is a copy of the default bundle's files, to change.
func defaultFiles(t testing.TB) map[string][]byte {
	t.Helper()
	b, err := Builtin(DefaultName)
	if err != nil {
		t.Fatal(err)
	}
	return maps.Clone(b.Files)
}

// tinyModules is the smallest complete bundle: every kind denies.
func tinyModules() map[string]string {
	m := map[string]string{}
	for _, k := range Kinds {
		m[string(k)+".rego"] = "package carrel." + string(k) + "\n\n" +
			`decision := {"allow": false, "rule": "carrel.` + string(k) + `.default_deny", "reason": "tiny"}` + "\n"
	}
	m["api.rego"] += "\nprocedures := {\"/carrel.api.v1.VMService/CreateVM\": \"admin\"}\n"
	m["fs.rego"] += "\nsandbox := {\"read_write\": [\"/workspace\"], \"read_only\": []}\n"
	m["tiny_test.rego"] = "package carrel.tiny_test\n\ntest_denies if not data.carrel.exec.decision.allow\n"
	return m
}

func tinyBundle(t *testing.T, change func(m map[string]string)) (*Bundle, error) {
	t.Helper()
	m := tinyModules()
	if change != nil {
		change(m)
	}
	files := map[string][]byte{}
	for p, s := range m {
		files[p] = []byte(s)
	}
	return NewBundle(files)
}

func TestTinyBundlePasses(t *testing.T) {
	b, err := tinyBundle(t, nil)
	if err != nil {
		t.Fatal(err)
	}
	p, results, err := Check(context.Background(), "tiny", b)
	if err != nil || len(results) != 1 {
		t.Fatalf("the tiny bundle: %v (results %+v)", err, results)
	}
	d, err := p.Decide(context.Background(), &GuestInput{VM: "x", Request: "checkpoint"})
	if err != nil || d.Allow || d.Rule != "carrel.guest.default_deny" || d.Reason != "tiny" {
		t.Errorf("tiny decision %+v, %v", d, err)
	}
}

func TestRejectedBundles(t *testing.T) {
	deep := strings.Repeat(`{"a":`, 40) + "1" + strings.Repeat("}", 40)
	cases := []struct {
		name   string
		change func(m map[string]string)
		check  bool   // rejected only by Check (tests), not by Compile
		want   string // in the error
	}{
		{"syntax error", func(m map[string]string) { m["exec.rego"] = "package carrel.exec\n\ndecision := {\n" }, false, "exec.rego"},
		{"rego v0", func(m map[string]string) {
			m["exec.rego"] = "package carrel.exec\n\ndecision = {\"allow\": false} { true }\n"
		}, false, "exec.rego"},
		{"v0 partial set", func(m map[string]string) { m["net.rego"] += "\ndeny[msg] { msg := \"x\" }\n" }, false, "net.rego"},
		{"no decision", func(m map[string]string) { m["net.rego"] = "package carrel.net\n\nverdict := false\n" }, false, "data.carrel.net.decision"},
		{"no package", func(m map[string]string) { delete(m, "guest.rego") }, false, "data.carrel.guest.decision"},
		{"no sandbox", func(m map[string]string) {
			m["fs.rego"] = strings.ReplaceAll(m["fs.rego"], "sandbox :=", "sandbox_rules :=")
		}, false, "data.carrel.fs.sandbox"},
		{"no procedures", func(m map[string]string) {
			m["api.rego"] = strings.ReplaceAll(m["api.rego"], "procedures :=", "procs :=")
		}, false, "data.carrel.api.procedures"},
		{"strict: unused variable", func(m map[string]string) { m["exec.rego"] += "\nx if { y := 1 }\n" }, false, "exec.rego"},
		{"strict: unused import", func(m map[string]string) {
			m["exec.rego"] = strings.Replace(m["exec.rego"], "\n", "\n\nimport data.nothing\n", 1)
		}, false, "exec.rego"},
		{"undefined function", func(m map[string]string) { m["exec.rego"] += "\nx := no_such_function(1)\n" }, false, "exec.rego"},
		{"data nested too deep", func(m map[string]string) { m[DataFile] = deep }, false, "nested deeper"},
		{"data not an object", func(m map[string]string) { m[DataFile] = `[1, 2]` }, false, DataFile},
		{"data not json", func(m map[string]string) { m[DataFile] = `{"settings": ` }, false, DataFile},
		{"a failing test", func(m map[string]string) {
			m["tiny_test.rego"] += "\ntest_allows if data.carrel.exec.decision.allow\n"
		}, true, "carrel.tiny_test.test_allows"},
		{"an erroring test", func(m map[string]string) {
			m["tiny_test.rego"] += "\ntest_errors if to_number(\"x\") == 1\n"
		}, true, "carrel.tiny_test.test_errors"},
		{"no tests", func(m map[string]string) { delete(m, "tiny_test.rego") }, true, "no Rego tests"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b, err := tinyBundle(t, c.change)
			if err != nil {
				t.Fatalf("NewBundle: %v", err)
			}
			_, cerr := Compile(context.Background(), "bad", b)
			_, _, err = Check(context.Background(), "bad", b)
			if c.check {
				if cerr != nil {
					t.Fatalf("Compile: %v; want only Check to reject it", cerr)
				}
			} else if !errors.Is(cerr, ErrInvalidBundle) {
				t.Fatalf("Compile = %v, want ErrInvalidBundle", cerr)
			}
			if !errors.Is(err, ErrInvalidBundle) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Check = %v, want ErrInvalidBundle mentioning %q", err, c.want)
			}
		})
	}
}

func TestNewBundleRefuses(t *testing.T) {
	ok := []byte("package carrel.x\n")
	for name, files := range map[string]map[string][]byte{
		"no files":       {},
		"a readme":       {"a.rego": ok, "README.md": []byte("# hi")},
		"nested data":    {"a.rego": ok, "sub/data.json": []byte("{}")},
		"absolute path":  {"/a.rego": ok},
		"dotdot path":    {"../a.rego": ok},
		"unclean path":   {"a/./b.rego": ok},
		"not utf-8":      {"a.rego": []byte("package carrel.x\n# \xff\n")},
		"too many bytes": {"a.rego": make([]byte, MaxBundleBytes+1)},
	} {
		if _, err := NewBundle(files); !errors.Is(err, ErrInvalidBundle) {
			t.Errorf("%s: NewBundle = %v, want ErrInvalidBundle", name, err)
		}
	}
	many := map[string][]byte{}
	for i := range MaxBundleFiles + 1 {
		many[strings.Repeat("a", i+1)+".rego"] = ok
	}
	if _, err := NewBundle(many); !errors.Is(err, ErrInvalidBundle) {
		t.Errorf("%d files: NewBundle = %v, want ErrInvalidBundle", len(many), err)
	}
	if _, err := FromFiles(map[string][]byte{"notes.txt": []byte("x")}); !errors.Is(err, ErrInvalidBundle) {
		t.Errorf("FromFiles with a text file = %v, want ErrInvalidBundle", err)
	}
	// The revision is of content and paths, not of map order.
	a, _ := NewBundle(map[string][]byte{"a.rego": ok, "b.rego": ok})
	b, _ := NewBundle(map[string][]byte{"b.rego": ok, "a.rego": ok})
	c, _ := NewBundle(map[string][]byte{"a.rego": ok, "c.rego": ok})
	if a.Revision != b.Revision || a.Revision == c.Revision {
		t.Errorf("revisions %s %s %s: want the first two equal, the third different", a.Revision, b.Revision, c.Revision)
	}
}

// A decision that is not a well-formed object is a deny, whatever it says.
func TestMalformedDecisionDenies(t *testing.T) {
	cases := []struct {
		name     string
		decision string
		rule     string
	}{
		{"a string", `decision := "allow"`, "carrel.exec.undefined"},
		{"a boolean", `decision := true`, "carrel.exec.undefined"},
		{"a set", `decision contains {"allow": true, "rule": "carrel.exec.x"}`, "carrel.exec.undefined"},
		{"allow not a boolean", `decision := {"allow": "true", "reason": "sneaky"}`, "carrel.exec.undefined"},
		{"allow missing", `decision := {"rule": "", "reason": "nothing"}`, "carrel.exec.undefined"},
		{"undefined for this input", `decision := {"allow": true, "rule": "carrel.exec.x", "reason": "x"} if input.user == "someone else"`, "carrel.exec.undefined"},
		{"conflicting", `decision := {"allow": true, "rule": "carrel.exec.x", "reason": "x"} if input.user == "agent"` + "\n" +
			`decision := {"allow": false, "rule": "carrel.exec.y", "reason": "y"} if input.user == "agent"`, "carrel.eval_error"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b, err := tinyBundle(t, func(m map[string]string) {
				m["exec.rego"] = "package carrel.exec\n\n" + c.decision + "\n"
				delete(m, "tiny_test.rego")
			})
			if err != nil {
				t.Fatal(err)
			}
			p, err := Compile(context.Background(), "malformed", b)
			if err != nil {
				t.Fatal(err)
			}
			d, err := p.Decide(context.Background(), &ExecInput{Caller: peer(0), Argv: []string{"ls"}})
			if d.Allow || d.Rule != c.rule || d.Err() == nil {
				t.Errorf("decision allow %v rule %s (%s), err %v; want a deny by %s", d.Allow, d.Rule, d.Reason, err, c.rule)
			}
		})
	}
}

// A rule that loops is cut off at EvalTimeout and the call is denied.
func TestEvalTimeoutDenies(t *testing.T) {
	b, err := tinyBundle(t, func(m map[string]string) {
		m["exec.rego"] = `package carrel.exec

decision := {"allow": true, "rule": "carrel.exec.slow", "reason": "slow"} if {
	r := numbers.range(0, 100000)
	some i in r
	some j in r
	i + j < 0
} else := {"allow": true, "rule": "carrel.exec.after", "reason": "searched everything"}
`
	})
	if err != nil {
		t.Fatal(err)
	}
	p, err := Compile(context.Background(), "slow", b)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	d, err := p.Decide(context.Background(), &ExecInput{Caller: peer(0), Argv: []string{"ls"}})
	took := time.Since(start)
	if err == nil || d.Allow || d.Rule != "carrel.eval_error" {
		t.Errorf("decision allow %v rule %s, err %v; want an eval error and a deny", d.Allow, d.Rule, err)
	}
	if took < EvalTimeout || took > EvalTimeout+2*time.Second {
		t.Errorf("cut off after %v, want about %v", took, EvalTimeout)
	}
	// The caller's own deadline counts too.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	start = time.Now()
	if d, err := p.Decide(ctx, &ExecInput{Caller: peer(0), Argv: []string{"ls"}}); err == nil || d.Allow {
		t.Errorf("with a 20ms deadline: allow %v, err %v", d.Allow, err)
	}
	if took := time.Since(start); took >= EvalTimeout {
		t.Errorf("a 20ms deadline took %v", took)
	}
}

func TestConcurrentDecisions(t *testing.T) {
	p := compiledDefault(t)
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 150 {
				allowed := i%2 == 0
				pth := "/workspace/f"
				if !allowed {
					pth = "/etc/shadow"
				}
				d, err := p.Decide(context.Background(), &FSInput{Caller: peer(uint32(g)), VM: "demo", Operation: OpRead, Path: pth})
				if err != nil || d.Allow != allowed {
					errs <- errors.Join(err, errors.New(pth+": "+d.Rule))
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

var benchInputs = map[Kind]func() Input{
	KindExec: func() Input {
		return &ExecInput{Caller: peer(1000), VM: "demo", Argv: []string{"go", "test", "./..."}, Env: map[string]string{"HOME": "/workspace"}, Cwd: "/workspace/src", User: "agent"}
	},
	KindFS: func() Input {
		return &FSInput{Caller: peer(1000), VM: "demo", Operation: OpWrite, Path: "/workspace/src/main.go"}
	},
	KindNet: func() Input {
		return &NetInput{VM: "demo", Direction: DirEgress, Host: "registry.npmjs.org", Port: 443}
	},
	KindAPI: func() Input {
		return &APIInput{Caller: token("demo"), Procedure: "/carrel.api.v1.VMService/Exec", VM: "demo"}
	},
}

// BenchmarkDecide measures one decision of the default policy per kind,
// with the rules evaluated (Evaluate) and served from the cache (Decide on
// a repeated input):
//
//	go test -run '^$' -bench Decide -benchmem -cpuprofile cpu.out ./policy/
func BenchmarkDecide(b *testing.B) {
	p := compiledDefault(b)
	for _, k := range []Kind{KindExec, KindFS, KindNet, KindAPI} {
		for _, mode := range []string{"evaluated", "cached"} {
			b.Run(string(k)+"/"+mode, func(b *testing.B) {
				in := benchInputs[k]()
				ctx := context.Background()
				decide := p.Evaluate
				if mode == "cached" {
					decide = p.Decide
				}
				b.ReportAllocs()
				for b.Loop() {
					if _, err := decide(ctx, in); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
