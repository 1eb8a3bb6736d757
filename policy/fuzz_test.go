package policy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/open-policy-agent/opa/v1/rego"
)

// FuzzDecodeInput feeds arbitrary documents of every kind to DecodeInput
// and what it accepts to the default policy: nothing may panic, every
// refusal is ErrInvalidInput, a decision depends on its input alone, and
// it is the decision of the rules as written.
func FuzzDecodeInput(f *testing.F) {
	seeds := map[Kind][]string{
		KindAPI: {
			`{"version":1,"caller":{"type":"peer","uid":0,"gid":0,"pid":1},"daemon_uid":0,"procedure":"/carrel.api.v1.VMService/CreateVM","vm":"a"}`,
			`{"version":1,"caller":{"type":"token","token_id":"tok-1","vm":"a"},"procedure":"/carrel.api.v1.VMService/Exec","vm":"b"}`,
			`{"caller":{"type":"peer","uid":0},"procedure":"/carrel.api.v1.VMService/CreateVM","vm":"a","gpus":["0000:4A:00.0","0000:01:00.0","00000:01:00.0"]}`,
		},
		KindExec: {
			`{"version":1,"caller":{"type":"peer","uid":1000},"vm":"demo","argv":["sh","-c","ls"],"env":{"K":"V"},"cwd":"/workspace","user":"agent","tty":false}`,
			`{"caller":{"type":"peer"},"argv":["/usr/bin/curl"],"cwd":"/workspace/../root/.ssh/","user":"root"}`,
		},
		KindFS: {
			`{"version":1,"caller":{"type":"peer","uid":1000},"vm":"demo","operation":"write","path":"/workspace/a.txt","recursive":false}`,
			`{"caller":{"type":"peer"},"operation":"read","path":"/workspace/../etc/shadow","recursive":true}`,
		},
		KindNet: {
			`{"version":1,"vm":"demo","direction":"egress","host":"registry.npmjs.org","port":443,"protocol":"tcp"}`,
			`{"caller":{"type":"token","token_id":"t","vm":"demo"},"vm":"demo","direction":"forward","host":"Local.Host.","port":8080}`,
			`{"version":1,"vm":"demo","direction":"egress","host":"allowed.test","port":8443,"protocol":"tcp","addresses":[{"ip":"127.0.0.1","class":"public"},{"ip":"::ffff:10.0.0.1"},{"ip":"127.0.0.1"}]}`,
			`{"vm":"demo","direction":"egress","host":"::FFFF:169.254.169.254","port":80,"ip_literal":false,"addresses":[{"ip":"8.8.8.8"}]}`,
		},
		KindGuest: {
			`{"version":1,"vm":"demo","request":"checkpoint","args":{"name":"x"}}`,
		},
	}
	for i, k := range Kinds {
		for _, s := range seeds[k] {
			f.Add([]byte(s), uint8(i))
		}
	}
	f.Add([]byte(`{"version":2}`), uint8(0))
	f.Add([]byte(`{"a":[[[[[[[[[]]]]]]]]]}`), uint8(4))
	f.Add([]byte(`{"vm":"\u0000","request":"\ud800"}`), uint8(4))
	ctx := context.Background()
	p := compiledDefault(f) // once per process, not per input
	written := asWritten(p)
	f.Fuzz(func(t *testing.T, src []byte, kind uint8) {
		k := Kinds[int(kind)%len(Kinds)]
		in, err := DecodeInput(k, src)
		if err != nil {
			if !errors.Is(err, ErrInvalidInput) || in != nil {
				t.Fatalf("DecodeInput = %v, %v; want nil and ErrInvalidInput", in, err)
			}
			return
		}
		if in.Kind() != k {
			t.Fatalf("DecodeInput(%s) gave a %s input", k, in.Kind())
		}
		digest := Digest(in)
		d1, err1 := p.Decide(ctx, in)
		d2, err2 := p.Decide(ctx, in)
		for _, err := range []error{err1, err2} {
			if err != nil && !errors.Is(err, ErrInvalidInput) {
				t.Fatalf("Decide(%s): %v", src, err)
			}
		}
		if (err1 == nil) != (err2 == nil) {
			t.Fatalf("Decide(%s) twice: %v, then %v", src, err1, err2)
		}
		if (err1 != nil || err2 != nil) && (d1.Allow || d2.Allow) {
			t.Fatalf("Decide(%s) allowed with an error", src)
		}
		if d1.ID == d2.ID {
			t.Fatalf("two decisions share id %s", d1.ID)
		}
		// The second may come from the cache: it must say the same.
		if !bytes.Equal(d1.Input, d2.Input) {
			t.Fatalf("Decide(%s) twice: canonical inputs %s and %s", src, d1.Input, d2.Input)
		}
		d1.ID, d2.ID, d1.Time, d2.Time, d1.Cached, d2.Cached = "", "", time.Time{}, time.Time{}, false, false
		d1.Input, d2.Input = nil, nil
		if !reflect.DeepEqual(d1, d2) {
			t.Fatalf("Decide(%s) twice:\n%+v\n%+v", src, d1, d2)
		}
		if err1 == nil && d1.InputDigest != digest {
			t.Fatalf("Decide changed an input DecodeInput had normalised: %s is now %+v", src, in)
		}
		// The settings worked out at compile time change no decision.
		if w, errW := written.Evaluate(ctx, in); errW == nil && (w.Allow != d1.Allow || w.Rule != d1.Rule || w.Reason != d1.Reason) {
			t.Fatalf("Decide(%s): %v by %s (%s); the rules as written: %v by %s (%s)", src, d1.Allow, d1.Rule, d1.Reason, w.Allow, w.Rule, w.Reason)
		}
		// The canonical form is a fixed point: it decodes to the same input.
		canon, err := json.Marshal(in)
		if err != nil {
			t.Fatal(err)
		}
		again, err := DecodeInput(k, canon)
		if err != nil || Digest(again) != digest {
			t.Fatalf("the canonical form %s of %s does not decode to itself: %v", canon, src, err)
		}
	})
}

// FuzzCleanPath checks that CleanPath's output is in the one form rules
// compare and that cleaning it again changes nothing.
func FuzzCleanPath(f *testing.F) {
	for _, s := range []string{"/", "//", "/..", "/../..", "/a/./b", "/a/b/../c/", "a/b", "", "/a\x00", "/\xff", "/.../a", "/a/..b/."} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, p string) {
		c, err := CleanPath(p)
		if err != nil {
			if !errors.Is(err, ErrInvalidInput) || c != "" {
				t.Fatalf("CleanPath(%q) = %q, %v", p, c, err)
			}
			return
		}
		c2, err := CleanPath(c)
		if err != nil || c2 != c {
			t.Fatalf("CleanPath(%q) = %q, and again %q, %v", p, c, c2, err)
		}
		if !strings.HasPrefix(c, "/") || strings.Contains(c, "//") || strings.Contains(c, "/./") || strings.Contains(c, "/../") ||
			strings.HasSuffix(c, "/.") || strings.HasSuffix(c, "/..") || (c != "/" && strings.HasSuffix(c, "/")) {
			t.Fatalf("CleanPath(%q) = %q, not clean", p, c)
		}
		if len(c) > len(p) || strings.IndexByte(c, 0) >= 0 {
			t.Fatalf("CleanPath(%q) = %q", p, c)
		}
	})
}

// fsSettings is settings.fs of the default data.json: the contract the fs
// rules implement, and the oracle FuzzFSDecision checks them against.
type fsSettings struct {
	ReadWrite   []string `json:"read_write"`
	ReadOnly    []string `json:"read_only"`
	SecretPaths []string `json:"secret_paths"`
	SecretNames []string `json:"secret_names"`
}

func defaultFSSettings(tb testing.TB) fsSettings {
	tb.Helper()
	b, err := Builtin(DefaultName)
	if err != nil {
		tb.Fatal(err)
	}
	var data struct {
		Settings struct {
			FS fsSettings `json:"fs"`
		} `json:"settings"`
	}
	if err := json.Unmarshal(b.Files[DataFile], &data); err != nil {
		tb.Fatal(err)
	}
	fs := data.Settings.FS
	if !slices.Contains(fs.ReadWrite, "/workspace") || !slices.Contains(fs.SecretPaths, "/etc/shadow") || !slices.Contains(fs.SecretNames, ".ssh") {
		tb.Fatalf("the default settings.fs lost /workspace, /etc/shadow or .ssh: %+v", fs)
	}
	return fs
}

// under is the rules' containment, by whole components.
func under(p, root string) bool {
	return p == root || root == "/" || strings.HasPrefix(p, root+"/")
}

// want is what settings.fs says of op on the clean path p.
func (s fsSettings) want(op, p string, recursive bool) (bool, string) {
	for _, sp := range s.SecretPaths {
		if under(p, sp) || recursive && under(sp, p) {
			return false, "carrel.fs.secret_path"
		}
	}
	for _, c := range strings.Split(p, "/") {
		if slices.Contains(s.SecretNames, c) {
			return false, "carrel.fs.secret_path"
		}
	}
	for _, r := range s.ReadWrite {
		if under(p, r) {
			return true, "carrel.fs.read_write_root"
		}
	}
	if op == OpRead || op == OpList || op == OpWatch {
		for _, r := range s.ReadOnly {
			if under(p, r) {
				return true, "carrel.fs.read_only_root"
			}
		}
	}
	return false, "carrel.fs.default_deny"
}

// FuzzFSDecision decides operations on paths under /workspace/ followed by
// fuzz bytes ("..", ".ssh", "//" and all) and checks each decision against
// settings.fs of the default data.json: a secret is always denied, every
// operation under a read-write root without a secret is allowed.
func FuzzFSDecision(f *testing.F) {
	for _, s := range []string{"a.txt", ".ssh/id_ed25519", "src/.env", "../etc/shadow", "../etc/shadow-", "../etc", "..", "../..",
		"x/../../workspacex", "../tmp/a", "../usr/bin/env", ".gnupg", "a/.aws/credentials", "././/a/", "../root", "../proc/kcore", ".envrc", "\xff", "a\x00"} {
		f.Add([]byte(s), uint8(1), false)
	}
	f.Add([]byte("../etc"), uint8(0), true)
	f.Add([]byte("../"), uint8(5), true)
	f.Add([]byte("../run"), uint8(6), true)
	ctx := context.Background()
	p, fs := compiledDefault(f), defaultFSSettings(f) // once per process, not per input
	ops := []string{OpRead, OpWrite, OpCreate, OpDelete, OpChmod, OpList, OpWatch}
	f.Fuzz(func(t *testing.T, suffix []byte, op uint8, recursive bool) {
		in := &FSInput{Caller: peer(1000), VM: "demo", Operation: ops[int(op)%len(ops)], Path: "/workspace/" + string(suffix), Recursive: recursive}
		d, err := p.Decide(ctx, in)
		if err != nil {
			if !errors.Is(err, ErrInvalidInput) || d.Allow {
				t.Fatalf("Decide(%q): allow %v, %v", in.Path, d.Allow, err)
			}
			return
		}
		clean, _ := CleanPath("/workspace/" + string(suffix))
		if in.Path != clean {
			t.Fatalf("decided on %q, want the clean %q", in.Path, clean)
		}
		allow, rule := fs.want(in.Operation, in.Path, recursive)
		if d.Allow != allow || d.Rule != rule {
			t.Fatalf("%s %q (recursive %v): allow %v by %s (%s); settings.fs says allow %v by %s",
				in.Operation, in.Path, recursive, d.Allow, d.Rule, d.Reason, allow, rule)
		}
		if (slices.Contains(strings.Split(in.Path, "/"), ".ssh") || under(in.Path, "/etc/shadow")) && d.Allow {
			t.Fatalf("%s %q allowed", in.Operation, in.Path)
		}
	})
}

// FuzzFSShortcut makes read-write roots, secret paths, secret names and a
// path from a few words that overlap one another (".env" and ".envx",
// "x.k" and "x.key", roots nested in roots and in secrets) and checks that
// fs.decision, shortcut and all, is what fs.check says for that path
// under those settings.
func FuzzFSShortcut(f *testing.F) {
	f.Add([]byte{0x01, 0x02}, []byte{0x81}, []byte{}, []byte{0x03}, uint8(0))
	f.Add([]byte{0x01, 0x03, 0x05}, []byte{0x81, 0x01, 0x83}, []byte{0x01, 0x86}, []byte{0x02, 0x05}, uint8(1))
	f.Add([]byte{0x01, 0x02, 0x06}, []byte{0x01, 0x02, 0x84, 0x81}, []byte{}, []byte{0x06}, uint8(2))
	f.Add([]byte{0x00}, []byte{0x80}, []byte{}, []byte{}, uint8(3))
	ctx := context.Background()
	p := compiledDefault(f) // once per process, not per input
	q, err := rego.New(rego.Compiler(p.compiler), rego.Store(p.store), rego.Query(`
		d := data.carrel.fs.decision with data.settings.fs as input.settings
		c := data.carrel.fs.check(input.operation, input.path, false) with data.settings.fs as input.settings`)).PrepareForEval(ctx)
	if err != nil {
		f.Fatal(err)
	}
	words := []string{"", "w", "a", ".env", ".envx", "x.k", "x.key", ".ssh", "b+"}
	paths := func(src []byte) []string {
		var out []string
		cur := ""
		for _, c := range src {
			cur += "/" + words[int(c&0x7f)%len(words)]
			if c&0x80 != 0 {
				out = append(out, cur)
				cur = ""
			}
		}
		return out
	}
	ops := []string{OpRead, OpWrite, OpList, "exec"}
	f.Fuzz(func(t *testing.T, path, rw, secretPaths, names []byte, op uint8) {
		clean, err := CleanPath(strings.Join(paths(append(path, 0x80)), ""))
		if err != nil {
			return
		}
		var secretNames []string
		for _, c := range names {
			secretNames = append(secretNames, words[int(c)%len(words)])
		}
		settings := map[string]any{
			"read_write": append(paths(rw), "/workspace"), "read_only": []string{"/usr"},
			"secret_paths": paths(secretPaths), "secret_names": secretNames,
		}
		for _, k := range []string{"read_write", "secret_paths", "secret_names"} {
			if settings[k] == nil {
				settings[k] = []string{}
			}
		}
		in := map[string]any{"version": 1, "vm": "demo", "operation": ops[int(op)%len(ops)], "path": clean, "recursive": false, "settings": settings}
		rs, err := q.Eval(ctx, rego.EvalInput(in))
		if err != nil || len(rs) != 1 {
			t.Fatalf("%v: %v, %v", in, rs, err)
		}
		if d, c := rs[0].Bindings["d"], rs[0].Bindings["c"]; !reflect.DeepEqual(d, c) {
			t.Fatalf("%s %q with settings %v: the decision is %v, check says %v", in["operation"], clean, settings, d, c)
		}
	})
}
