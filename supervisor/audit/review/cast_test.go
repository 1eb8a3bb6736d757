package review

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/carrel-os/carrel/supervisor/audit"
)

// expectedTerminal is an oracle for a session's terminal, built from its
// records the simple way: each command's prompt at its intent's time and
// each chunk at the intent's time plus its offset, sorted by time (then
// record order), with prompts given by the test.
type oracleEvent struct {
	at       time.Time
	seq, idx uint64
	prompt   string // for a prompt: the command line
	tty      bool
	stream   string // for output: "<exec seq> <stream>"
	data     []byte
}

func oracle(t *testing.T, sess *Session, lines map[uint64]string) []oracleEvent {
	t.Helper()
	start := map[uint64]time.Time{}
	tty := map[uint64]bool{}
	var evs []oracleEvent
	for _, e := range sess.Entries {
		var d struct {
			Action string     `json:"action"`
			TTY    bool       `json:"tty"`
			Exec   *uint64    `json:"exec"`
			Chunks [][2]int64 `json:"chunks"`
			Stream string     `json:"stream"`
		}
		json.Unmarshal(e.Data, &d)
		switch {
		case e.Kind == audit.KindIntent && d.Action == "exec":
			start[e.Seq], tty[e.Seq] = e.Time, d.TTY
			evs = append(evs, oracleEvent{at: e.Time, seq: e.Seq, prompt: lines[e.Seq], tty: d.TTY})
		case e.Kind == audit.KindExecOutput && d.Stream != "stdin":
			blob, err := os.ReadFile(must(audit.BlobPath(sessDir, e.Blobs[0])))
			if err != nil {
				t.Fatal(err)
			}
			off := int64(0)
			for i, c := range d.Chunks {
				evs = append(evs, oracleEvent{at: start[*d.Exec].Add(time.Duration(c[0])), seq: e.Seq, idx: uint64(i + 1),
					stream: fmt.Sprint(*d.Exec, d.Stream), tty: tty[*d.Exec], data: blob[off : off+c[1]]})
				off += c[1]
			}
		}
	}
	slices.SortStableFunc(evs, func(a, b oracleEvent) int {
		if c := a.at.Compare(b.at); c != 0 {
			return c
		}
		if a.seq != b.seq {
			return int(a.seq) - int(b.seq)
		}
		return int(a.idx) - int(b.idx)
	})
	return evs
}

// sessDir is the log the oracle reads blobs from (set by each test).
var sessDir string

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

func (s *sampleLog) promptLines() map[uint64]string {
	return map[uint64]string{
		s.echo:    "echo 'héllo wörld ✓'",
		s.script:  `sh -c $'printf \'<script>\'\x1b]0;title\a'`,
		s.sleeper: "sleep 1",
	}
}

func TestCast(t *testing.T) {
	s := newSampleLog(t)
	r, sess := loadSample(t, s)
	sessDir = r.Dir()
	var buf bytes.Buffer
	st, err := WriteCast(&buf, r.Dir(), sess, sess.Commands(), CastOptions{Title: "t", IdleTimeLimit: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	hdr, evs := parseCast(t, buf.Bytes())
	first := sess.entry(s.echo).Time
	if int64(hdr["timestamp"].(float64)) != first.Unix() || hdr["title"] != "t" || hdr["idle_time_limit"] != float64(2) {
		t.Errorf("header %v", hdr)
	}

	// The text, concatenated, is the prompts and the bytes recorded, in
	// the order the oracle puts them.
	// A stream's bytes go out as whole characters: what ends a chunk in
	// the middle of one waits for the stream's next chunk (the sample is
	// all UTF-8). The terminal's new-line mode is on for commands without
	// a terminal, off for those with one, switched as their output comes.
	var want strings.Builder
	var wantTimes []float64
	pending := map[string][]byte{}
	lnm := ""
	mode := func(tty bool) string {
		m := "\x1b[20h"
		if tty {
			m = "\x1b[20l"
		}
		if m == lnm {
			return ""
		}
		lnm = m
		return m
	}
	for _, ev := range oracle(t, sess, s.promptLines()) {
		if ev.prompt == "" {
			p := append(pending[ev.stream], ev.data...)
			k := len(p)
			for k > 0 && !utf8.Valid(p[:k]) {
				k--
			}
			if k > 0 {
				want.WriteString(mode(ev.tty))
			}
			want.Write(p[:k])
			pending[ev.stream] = p[k:]
			continue
		}
		if w := want.String(); w != "" && !strings.HasSuffix(w, "\n") {
			want.WriteString("\r\n")
		}
		want.WriteString(mode(ev.tty) + "\x1b[1;32m$\x1b[0m " + ev.prompt + "\r\n")
		wantTimes = append(wantTimes, ev.at.Sub(first).Seconds())
	}
	var got strings.Builder
	for _, ev := range evs {
		got.WriteString(ev.Text)
	}
	if got.String() != want.String() {
		t.Errorf("cast text:\n got %q\nwant %q", got.String(), want.String())
	}
	if st.Bytes != int64(len(s.echoOut)+len(s.scriptOut)+len(s.scriptErr)) || st.Omitted != 0 || st.Events != len(evs) {
		t.Errorf("stats %+v, %d events", st, len(evs))
	}
	var markers []float64
	for _, m := range st.Markers {
		markers = append(markers, m.T)
	}
	if len(markers) != 3 || !close6(markers, wantTimes) {
		t.Errorf("markers %v, want %v", markers, wantTimes)
	}

	// A character split between chunks is held back whole: no event
	// holds half of one, and each chunk's event is at its own time.
	echoStart := sess.entry(s.echo).Time
	for i, c := range []struct {
		text string
		ns   int64
	}{{"héllo w", 1e6}, {"örld ", 2e6}, {"✓\n", 250e6}} {
		k := slices.IndexFunc(evs, func(ev castEvent) bool { return strings.TrimPrefix(ev.Text, "\x1b[20h") == c.text })
		if k < 0 {
			t.Errorf("echo chunk %d: no event %q", i, c.text)
			continue
		}
		if want := echoStart.Add(time.Duration(c.ns)).Sub(first).Seconds(); math.Abs(evs[k].T-want) > 1e-6 {
			t.Errorf("echo chunk %d at %f, want %f", i, evs[k].T, want)
		}
	}
	if strings.Contains(got.String(), "\uFFFD") {
		t.Error("U+FFFD in a cast of valid UTF-8")
	}
}

func close6(a, b []float64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if math.Abs(a[i]-b[i]) > 1e-6 {
			return false
		}
	}
	return true
}

func TestCastInvalidUTF8(t *testing.T) {
	// Bytes that are not UTF-8, and a character whose last byte never
	// comes, across stdout and stderr chunks that interleave.
	out := []byte("a\xffb\xe2\x9c")
	errOut := []byte("\xe2\x9c\x93!")
	dir, _ := newExecLog(t, []string{"bin"},
		execOut{"stdout", out, []int{2, 3}, []int64{1e6, 3e6}},
		execOut{"stderr", errOut, []int{1, 3}, []int64{2e6, 4e6}})
	r := openReader(t, dir)
	sess, err := LoadSession(r, testSession)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if _, err := WriteCast(&buf, dir, sess, sess.Commands(), CastOptions{}); err != nil {
		t.Fatal(err)
	}
	_, evs := parseCast(t, buf.Bytes())
	var texts []string
	for _, ev := range evs[1:] {
		texts = append(texts, ev.Text)
	}
	// stdout "a\xff" -> "a\uFFFD"; stderr "\xe2" held; stdout "b\xe2\x9c":
	// "b" and the rest held; stderr "\x9c\x93!" completes "✓"; at the end
	// stdout's "\xe2\x9c" never completed.
	want := []string{"a\uFFFD", "b", "✓!", "\uFFFD"}
	if !slices.Equal(texts, want) {
		t.Errorf("events %q, want %q", texts, want)
	}
}

func TestCastCapAndMissingBlob(t *testing.T) {
	s := newSampleLog(t)
	r, sess := loadSample(t, s)
	// The echo's output blob is gone.
	echoOut := sess.entry(s.echo + 1)
	if err := os.Remove(must(audit.BlobPath(r.Dir(), echoOut.Blobs[0]))); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	st, err := WriteCast(&buf, r.Dir(), sess, sess.Commands(), CastOptions{MaxBytes: 20})
	if err != nil {
		t.Fatal(err)
	}
	_, evs := parseCast(t, buf.Bytes())
	var text strings.Builder
	for _, ev := range evs {
		text.WriteString(ev.Text)
	}
	if !strings.Contains(text.String(), "cannot be read: blob "+echoOut.Blobs[0]+" is missing") {
		t.Errorf("no note of the missing blob: %q", text.String())
	}
	total := int64(len(s.scriptOut) + len(s.scriptErr) + len(s.echoOut))
	if st.Bytes > 20 || st.Omitted != total-st.Bytes || !strings.Contains(evs[len(evs)-1].Text, "the cast stops here") {
		t.Errorf("stats %+v; last event %q", st, evs[len(evs)-1].Text)
	}
}

func TestCastOneByteChunks(t *testing.T) {
	// Every chunk one byte: every multi-byte character is split.
	out := []byte("日本語 — ünïcode ✓ 🎉\r\nline two\n")
	sizes, ns := make([]int, len(out)), make([]int64, len(out))
	for i := range out {
		sizes[i], ns[i] = 1, int64(i)*1e6
	}
	dir, _ := newExecLog(t, []string{"cat", "x"}, execOut{"stdout", out, sizes, ns})
	r := openReader(t, dir)
	sess, err := LoadSession(r, testSession)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if _, err := WriteCast(&buf, dir, sess, sess.Commands(), CastOptions{}); err != nil {
		t.Fatal(err)
	}
	_, evs := parseCast(t, buf.Bytes())
	if evs[0].Text != "\x1b[20h\x1b[1;32m$\x1b[0m cat x\r\n" {
		t.Errorf("prompt %q", evs[0].Text)
	}
	var got strings.Builder
	for _, ev := range evs[1:] {
		got.WriteString(ev.Text)
	}
	if got.String() != string(out) {
		t.Errorf("cast output %q, recorded %q", got.String(), out)
	}
	// One event per character: a character's last byte's time.
	if n := utf8.RuneCount(out); len(evs)-1 != n {
		t.Errorf("%d output events for %d characters", len(evs)-1, n)
	}
}

// TestCastLineModes: output of a command without a terminal that comes
// after a prompt of one with a terminal switches new-line mode back on.
func TestCastLineModes(t *testing.T) {
	dir := t.TempDir()
	l, err := audit.Open(dir, audit.Options{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	w := &writer{t: t, l: l, ctx: context.Background()}
	w.exec([]string{"make"}, false, []execOut{{"stdout", []byte("built\n"), []int{6}, []int64{10e9}}}, 0)
	w.exec([]string{"top"}, true, []execOut{{"stdout", []byte("\x1b[H\x1b[2Jtop\r\n"), []int{13}, []int64{1e6}}}, 0)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	r := openReader(t, dir)
	sess, err := LoadSession(r, testSession)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if _, err := WriteCast(&buf, dir, sess, sess.Commands(), CastOptions{}); err != nil {
		t.Fatal(err)
	}
	_, evs := parseCast(t, buf.Bytes())
	var texts []string
	for _, ev := range evs {
		texts = append(texts, ev.Text)
	}
	want := []string{
		"\x1b[20h\x1b[1;32m$\x1b[0m make\r\n",
		"\x1b[20l\x1b[1;32m$\x1b[0m top\r\n",
		"\x1b[H\x1b[2Jtop\r\n",
		"\x1b[20hbuilt\n",
	}
	if !slices.Equal(texts, want) {
		t.Errorf("events %q, want %q", texts, want)
	}
}
