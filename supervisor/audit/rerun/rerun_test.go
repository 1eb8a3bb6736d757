package rerun

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/audit/review"
)

// TestBuild: a plan holds the session's commands with their streams and
// exits, its writes with their content and its other file actions, in
// order; what cannot be repeated is listed, and other sessions are not
// mixed in.
func TestBuild(t *testing.T) {
	dir := t.TempDir()
	l, err := audit.Open(dir, audit.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	const ses = "ses_0123456789abcdef"
	rec := func(kind string, data string, blobs ...string) audit.Record {
		return audit.Record{Kind: kind, VM: "a", Session: ses, Provenance: audit.Host, Data: []byte(data), Blobs: blobs}
	}
	must := func(_ uint64, err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	put := func(s string) string {
		d, err := l.PutBlob(strings.NewReader(s))
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	must(l.Append(ctx, rec(audit.KindVMLifecycle, `{"event":"created","image_digest":"sha256:aa","policy":"default","policy_revision":"sha256:bb","memory_bytes":268435456,"cpus":1,`+
		`"origin":{"vm":"src","name":"before","session":"ses_1111111111111111","fork":true}}`)))
	must(l.Append(ctx, audit.Record{Kind: audit.KindIntent, VM: "b", Session: "ses_ffffffffffffffff", Provenance: audit.Host, Data: []byte(`{"action":"exec","argv":["other"]}`)}))
	p, err := l.Begin(ctx, rec(audit.KindIntent, `{"action":"exec","argv":["cat"],"cwd":"/workspace","user":"agent"}`))
	if err != nil {
		t.Fatal(err)
	}
	in, out := put("typed\n"), put("typed\n")
	must(l.Append(ctx, rec(audit.KindExecOutput, `{"exec":`+itoa(p.Seq())+`,"stream":"stdin","offset":0,"size":6,"chunks":[[1,6]]}`, in)))
	must(l.Append(ctx, rec(audit.KindExecOutput, `{"exec":`+itoa(p.Seq())+`,"stream":"stdout","offset":0,"size":6,"chunks":[[2,6]]}`, out)))
	must(p.End(ctx, rec(audit.KindExecExit, `{"code":0,"stdout_bytes":6,"stderr_bytes":0}`)))
	w, _ := l.Begin(ctx, rec(audit.KindIntent, `{"action":"file.write","path":"/workspace/x","mode":420}`))
	must(w.End(ctx, rec(audit.KindFileOp, `{"op":"write","path":"/workspace/x","size":2,"digest":"sha256:cc"}`, put("hi"))))
	rm, _ := l.Begin(ctx, rec(audit.KindIntent, `{"action":"file.remove","path":"/workspace/nope"}`))
	must(rm.End(ctx, rec(audit.KindFileOp, `{"op":"remove","path":"/workspace/nope","size":0,"error":"not found"}`)))
	must(l.Append(ctx, rec(audit.KindIntent, `{"action":"exec","argv":["sleep","1"],"detach":true}`)))
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}

	r, err := audit.OpenReader(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	s, err := review.LoadSession(r, ses)
	if err != nil {
		t.Fatal(err)
	}
	plan, err := Build(s)
	if err != nil {
		t.Fatal(err)
	}
	if plan.ImageDigest != "sha256:aa" || plan.Policy != "default" || plan.PolicyRevision != "sha256:bb" || plan.MemoryBytes != 256<<20 || plan.VM != "a" {
		t.Errorf("plan header %+v", plan)
	}
	// A session that began at a snapshot is rerun from it.
	if o := plan.Origin; o == nil || o.VM != "src" || o.Name != "before" || o.Session != "ses_1111111111111111" {
		t.Errorf("plan origin %+v", plan.Origin)
	}
	if len(plan.Steps) != 3 {
		t.Fatalf("%d steps: %+v", len(plan.Steps), plan.Steps)
	}
	x := plan.Steps[0]
	if x.Kind != "exec" || x.Argv[0] != "cat" || len(x.Stdin) != 1 || x.Stdin[0] != in || len(x.Stdout) != 1 || x.Code == nil || *x.Code != 0 {
		t.Errorf("exec step %+v", x)
	}
	if w := plan.Steps[1]; w.Kind != "write" || w.Path != "/workspace/x" || w.Mode != 0o644 || w.Digest != "sha256:cc" || w.Content == "" {
		t.Errorf("write step %+v", w)
	}
	if f := plan.Steps[2]; f.Kind != "file" || f.Action != "file.remove" || f.Failed != "not found" {
		t.Errorf("file step %+v", f)
	}
	if len(plan.Skipped) != 1 || !strings.Contains(plan.Skipped[0], "detached") {
		t.Errorf("skipped %v", plan.Skipped)
	}
}

func itoa(n uint64) string { return strconv.FormatUint(n, 10) }

func TestFirstDiff(t *testing.T) {
	for _, c := range []struct{ want, got, has string }{
		{"a\nb\n", "a\nb\n", ""},
		{"a\nb\n", "a\nc\n", "line 2"},
		{"abc", "ab", "prefix"},
	} {
		d := firstDiff([]byte(c.want), []byte(c.got))
		if (c.has == "") != (d == "") || !strings.Contains(d, c.has) {
			t.Errorf("firstDiff(%q, %q) = %q, want it to say %q", c.want, c.got, d, c.has)
		}
	}
}
