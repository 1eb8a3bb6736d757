package review

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/supervisor/audit"
)

func TestLoadSession(t *testing.T) {
	s := newSampleLog(t)
	_, sess := loadSample(t, s)
	if sess.VM != testVM {
		t.Errorf("vm %q", sess.VM)
	}
	var prev uint64
	for i, e := range sess.Entries {
		if i > 0 && e.Seq <= prev {
			t.Errorf("entries out of order: %d after %d", e.Seq, prev)
		}
		prev = e.Seq
		if e.Session != testSession && !(e.Session == "" && e.VM == testVM) {
			t.Errorf("record %d is not the session's: %+v", e.Seq, e.Record)
		}
		got, err := audit.Decode(e.Payload)
		if err != nil || got.Seq != e.Seq {
			t.Errorf("record %d: payload does not decode to it: %v", e.Seq, err)
		}
	}
	if sess.entry(s.looseSeq) == nil {
		t.Errorf("the VM's record %d, with no session, written during the session, is missing", s.looseSeq)
	}
	if sess.entry(s.lateLoose) != nil || sess.entry(s.otherSeq) != nil {
		t.Errorf("records outside the session are in it")
	}
	if sess.Entries[0].Kind != audit.KindVMLifecycle || sess.Entries[len(sess.Entries)-1].Seq != s.stopSeq {
		t.Errorf("session runs %d..%d", sess.Entries[0].Seq, sess.Entries[len(sess.Entries)-1].Seq)
	}
	if sess.End.TailBytes != 0 {
		t.Errorf("tail %+v", sess.End)
	}

	r := openReader(t, s.dir)
	if _, err := LoadSession(r, "ses_9999999999999999"); !errors.Is(err, ErrNotFound) {
		t.Errorf("unknown session: %v", err)
	}
}

// TestLoadSessionSegments: a session whose records lie in several
// segments reads as it does from one.
func TestLoadSessionSegments(t *testing.T) {
	one := newSampleLog(t)
	_, want := loadSample(t, one)
	s := newSampleLogWith(t, audit.Options{SegmentBytes: 1 << 10})
	rep, err := audit.Verify(s.dir, audit.VerifyOptions{})
	if err != nil || !rep.OK() {
		t.Fatalf("verify: %v %v", rep.Problems, err)
	}
	if rep.Segments < 3 {
		t.Fatalf("%d segments", rep.Segments)
	}
	_, got := loadSample(t, s)
	var wantKinds, gotKinds []string
	for _, e := range want.Entries {
		wantKinds = append(wantKinds, e.Kind)
	}
	for _, e := range got.Entries {
		gotKinds = append(gotKinds, e.Kind)
	}
	if !slices.Equal(gotKinds, wantKinds) {
		t.Errorf("across segments the session is %v, in one %v", gotKinds, wantKinds)
	}
	segs, _ := os.ReadDir(filepath.Join(s.dir, "segments"))
	first, last := got.Entries[0].Seq, got.Entries[len(got.Entries)-1].Seq
	var spanned int
	for _, e := range segs {
		var a, b uint64
		if _, err := fmt.Sscanf(e.Name(), "%d-%d.log", &a, &b); err == nil && b >= first && a <= last {
			spanned++
		}
	}
	if spanned < 2 {
		t.Errorf("the session spans %d rotated segments", spanned)
	}
}

func TestLoadSessionTornTail(t *testing.T) {
	s := newSampleLog(t)
	// An append in progress: a frame header promising more than is there.
	f, err := os.OpenFile(filepath.Join(s.dir, "records.log"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.Write([]byte{200, 0, 0, 0, 1, 2, 3, 4, '{', '"', 's'})
	f.Close()
	_, sess := loadSample(t, s)
	if sess.End.TailBytes != 11 || sess.Entries[len(sess.Entries)-1].Seq != s.stopSeq {
		t.Errorf("end %+v, last record %d", sess.End, sess.Entries[len(sess.Entries)-1].Seq)
	}
}

func TestScanVM(t *testing.T) {
	s := newSampleLog(t)
	r := openReader(t, s.dir)
	var seqs []uint64
	if _, err := ScanVM(r, testVM, func(e Entry) error {
		if e.VM != testVM {
			t.Errorf("record %d is vm %q's", e.Seq, e.VM)
		}
		seqs = append(seqs, e.Seq)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	// Every record of the VM: before, during and after the session.
	if seqs[0] != 1 || seqs[len(seqs)-1] != s.lateLoose {
		t.Errorf("seqs %v", seqs)
	}
	for _, q := range seqs {
		if q == s.otherSeq {
			t.Errorf("another VM's record %d", q)
		}
	}
	if _, err := ScanVM(r, "nope", func(Entry) error { return nil }); !errors.Is(err, ErrNotFound) {
		t.Errorf("unknown vm: %v", err)
	}
}

// TestRecentVM: the last records of a VM, read back from the log's end,
// further back when the VM's records are not near it, and no further than
// asked.
func TestRecentVM(t *testing.T) {
	s := newSampleLog(t)
	var all []uint64
	if _, err := ScanVM(openReader(t, s.dir), testVM, func(e Entry) error { all = append(all, e.Seq); return nil }); err != nil {
		t.Fatal(err)
	}
	recent := func(n int, maxBytes int64) ([]uint64, bool) {
		t.Helper()
		var seqs []uint64
		partial, err := RecentVM(openReader(t, s.dir), testVM, n, maxBytes, func(e Entry) error {
			if e.VM != testVM || Summary(&e) == "" {
				t.Errorf("record %d: vm %q, summary %q", e.Seq, e.VM, Summary(&e))
			}
			seqs = append(seqs, e.Seq)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return seqs, partial
	}
	if got, partial := recent(3, 64<<20); !slices.Equal(got, all[len(all)-3:]) || partial {
		t.Errorf("last 3: %v (partial %v), want %v", got, partial, all[len(all)-3:])
	}
	if got, partial := recent(1000, 64<<20); !slices.Equal(got, all) || partial {
		t.Errorf("all: %v (partial %v), want %v", got, partial, all)
	}
	// 3 MiB of another VM's records after the VM's last.
	l, err := audit.Open(s.dir, audit.Options{Logger: quiet, CheckpointInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	w := &writer{t: t, l: l, ctx: context.Background()}
	for range 100 {
		w.append(audit.Record{Kind: audit.KindAPICall, VM: "other", Data: w.data(map[string]any{"procedure": strings.Repeat("x", 30<<10)})})
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if got, partial := recent(3, 64<<20); !slices.Equal(got, all[len(all)-3:]) || partial {
		t.Errorf("last 3 behind another vm's: %v (partial %v), want %v", got, partial, all[len(all)-3:])
	}
	if got, partial := recent(3, 1<<20); len(got) != 0 || !partial {
		t.Errorf("last 3 from 1 MiB of another vm's: %v, partial %v", got, partial)
	}
	if got, partial := recent(0, 64<<20); len(got) != 0 || partial {
		t.Errorf("none asked: %v, partial %v", got, partial)
	}
}

func TestTimeline(t *testing.T) {
	s := newSampleLog(t)
	_, sess := loadSample(t, s)
	line := func(seq uint64) string { return TimelineLine(sess.entry(seq), false) }
	for _, tc := range []struct {
		seq  uint64
		want []string
	}{
		{s.echo, []string{"action.intent", "host", `exec $ echo 'héllo wörld ✓' (cwd /workspace, user agent)`, "by uid 1000 pid 4242"}},
		{s.echo + 1, []string{"exec.output", fmt.Sprintf("stdout %d B at 0 of exec %d (3 chunks)", len(s.echoOut), s.echo)}},
		{s.denySeq, []string{"policy.decision", "deny exec rule deny_network reason: no egress for curl [policy default@rev-7]"}},
		{s.fileOpSeq, []string{"file.op", "write /workspace/a.txt 5 B " + s.writeBlob, "(intent "}},
		{s.stopSeq, []string{"vm.lifecycle", " stopped"}},
		{s.watchSeq, []string{"watch.event", "guest", "2 events create /workspace/new.txt rename /workspace/b (from /workspace/a) (2 dropped)"}},
		{s.startingSeq, []string{"starting, image agent " + testImage[:19] + "…, root hash bc1b8827daf7…, policy default@rev-7, 2 cpus, 2.0 GiB memory, driver qemu"}},
		{s.startedSeq, []string{"started, image " + testImage[:19] + "…, root hash bc1b8827daf7…, policy default@rev-7"}},
	} {
		got := line(tc.seq)
		for _, w := range tc.want {
			if !strings.Contains(got, w) {
				t.Errorf("record %d: %q lacks %q", tc.seq, got, w)
			}
		}
	}
	// The exit of the failing command, and its control characters.
	var exit, intent string
	for i := range sess.Entries {
		e := &sess.Entries[i]
		if e.Intent != nil && *e.Intent == s.script {
			exit = TimelineLine(e, false)
		}
		if e.Seq == s.script {
			intent = TimelineLine(e, true)
		}
	}
	if !strings.Contains(exit, fmt.Sprintf("exit 1 stdout %d B, stderr %d B (intent %d)", len(s.scriptOut), len(s.scriptErr), s.script)) {
		t.Errorf("exit line %q", exit)
	}
	if strings.ContainsAny(intent, "\x1b\x07") || !strings.Contains(intent, `\x1b]0;title\a`) || !strings.Contains(intent, testSession) {
		t.Errorf("intent line %q: control characters must be escaped", intent)
	}
}

func TestKindFilter(t *testing.T) {
	f, err := ParseKinds([]string{"exec.*,policy.decision", " file.op "})
	if err != nil {
		t.Fatal(err)
	}
	for kind, want := range map[string]bool{"exec.exit": true, "exec.output": true, "policy.decision": true, "file.op": true, "action.intent": false, "execx": false} {
		if f.Match(kind) != want {
			t.Errorf("%s: %v", kind, !want)
		}
	}
	if !(KindFilter(nil)).Match("anything") {
		t.Error("empty filter")
	}
	for _, bad := range []string{"exec.*.x", "EXEC", "a b"} {
		if _, err := ParseKinds([]string{bad}); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestClean(t *testing.T) {
	for in, want := range map[string]string{
		"plain":                  "plain",
		"a\x1b[31mb":             `a\x1b[31mb`,
		"new\nline\ttab":         `new\nline\ttab`,
		"bad\xffbyte":            `bad\xffbyte`,
		"bidi\u202eevil":         `bidi\u202eevil`,
		"c1\u009bx":              `c1\u009bx`,
		"ünïcödé stays ✓":        "ünïcödé stays ✓",
		strings.Repeat("x", 300): strings.Repeat("x", maxField) + "…",
	} {
		if got := clean(in, maxField); got != want {
			t.Errorf("clean(%q) = %q, want %q", in, got, want)
		}
	}
	for in, want := range map[string]string{
		"ls":       "ls",
		"a b":      "'a b'",
		"it's":     `'it'\''s'`,
		"":         "''",
		"esc\x1b[": `$'esc\x1b['`,
	} {
		if got := shellWord(in); got != want {
			t.Errorf("shellWord(%q) = %q, want %q", in, got, want)
		}
	}
}
