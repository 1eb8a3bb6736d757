package review

import (
	"bytes"
	"encoding/json"
	"fmt"
	"html"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/supervisor/audit"
)

func writeSampleReport(t *testing.T, s *sampleLog, opts ReportOptions) string {
	t.Helper()
	r, sess := loadSample(t, s)
	opts.Now = func() time.Time { return created }
	var buf bytes.Buffer
	if err := WriteReport(&buf, r, sess, opts); err != nil {
		t.Fatal(err)
	}
	return buf.String()
}

// pageWithoutPlayer is the page less the vendored player's script and
// styles: what the template and the log make.
func pageWithoutPlayer(page string) string {
	page = strings.Replace(page, playerJS, "", 1)
	return strings.Replace(page, playerCSS, "", 1)
}

func TestReport(t *testing.T) {
	s := newSampleLog(t)
	page := writeSampleReport(t, s, ReportOptions{Key: logKey(t, s.dir)})
	ours := pageWithoutPlayer(page)
	_, sess := loadSample(t, s)
	if len(ours) == len(page) || !strings.Contains(page, playerJS) || !strings.Contains(page, playerCSS) {
		t.Fatal("the player is not embedded whole")
	}

	// What a reviewer looks for, escaped as HTML.
	for _, want := range []string{
		"Integrity checked",
		fmt.Sprintf("All %d of this session&#39;s records up to it have inclusion proofs against it.", len(sess.Entries)),
		"All 5 blobs the records reference match their digests.",
		testImage, "default@rev-7",
		`<td class="deny">deny</td><td class="mono">exec</td><td class="mono">deny_network</td><td>no egress for curl</td>`,
		`<td class="allow">allow</td><td class="mono">exec</td><td class="mono">allow_exec</td>`,
		"$ echo &#39;héllo wörld ✓&#39;",
		"héllo wörld ✓\n",
		"exit 1", "exit 0",
		`<td class="mono">write</td><td class="mono wrap">/workspace/a.txt</td><td class="num">5 B</td>`,
		`class="guest">guest (fanotify)</td><td class="mono">modify</td>`,
		"at most 64.0 KiB each here",
		`class="guest">guest (watch)</td><td class="mono">rename</td><td class="mono wrap">/workspace/b</td><td class="num"></td><td class="mono wrap">from /workspace/a</td>`,
		"2 events were dropped",
	} {
		if !strings.Contains(ours, want) {
			t.Errorf("the report lacks %q", want)
		}
	}

	// Guest text never becomes markup: not in the page, not in the
	// embedded recording.
	for _, bad := range []string{"<script>alert(1)</script>", "</pre><b>bold</b>", "<b>bold</b>", "\x1b]0;title", "\x1b]52"} {
		if strings.Contains(ours, bad) {
			t.Errorf("the report holds %q unescaped", bad)
		}
	}
	// (The script's stdout is interrupted by its stderr, as it happened.)
	if !strings.Contains(ours, "&lt;script&gt;al<span") || !strings.Contains(ours, "ert(1)&lt;/script&gt;") || !strings.Contains(ours, "err: &lt;/pre&gt;&lt;b&gt;bold&lt;/b&gt;") {
		t.Error("the command output is not shown escaped")
	}
	// Only the page's own scripts: the player and the one that starts it.
	if n := strings.Count(ours, "<script"); n != 2 {
		t.Errorf("%d script elements", n)
	}

	// Self-contained: nothing is loaded from anywhere.
	if !strings.Contains(ours, `Content-Security-Policy" content="default-src 'none';`) {
		t.Error("no Content-Security-Policy")
	}
	if m := regexp.MustCompile(`(?i)\b(src|href|action)\s*=|url\(|@import|https?://`).FindString(ours); m != "" {
		t.Errorf("the report refers to something outside it: %q", m)
	}

	// The embedded recording is the cast WriteCast makes, as a JS string.
	m := regexp.MustCompile(`var cast = ("(?:[^"\\]|\\.)*");`).FindStringSubmatch(ours)
	if m == nil {
		t.Fatal("no cast in the page")
	}
	var cast string
	if err := json.Unmarshal([]byte(m[1]), &cast); err != nil {
		t.Fatalf("the embedded cast is not a JS string literal JSON can read: %v", err)
	}
	r, sess := loadSample(t, s)
	var want bytes.Buffer
	if _, err := WriteCast(&want, r.Dir(), sess, sess.Commands(), CastOptions{Title: "carrel session " + testSession, MaxBytes: ReportCastMax}); err != nil {
		t.Fatal(err)
	}
	if cast != want.String() {
		t.Errorf("embedded cast differs from WriteCast's")
	}
	parseCast(t, []byte(cast))
	if strings.Contains(m[1], "</script") || strings.Contains(m[1], "<script") {
		t.Error("the cast can close its script element")
	}
}

func TestReportIntegrityProblems(t *testing.T) {
	s := newSampleLog(t)
	path, _ := audit.BlobPath(s.dir, s.writeBlob)
	os.Chmod(path, 0o600)
	os.WriteFile(path, []byte("HELLO"), 0o600)
	page := writeSampleReport(t, s, ReportOptions{})
	for _, want := range []string{
		"Integrity NOT established",
		html.EscapeString("with the log's own key.pub, which proves less"),
		"blob " + s.writeBlob + " (record " + itoa(s.fileOpSeq) + "): its content hashes to",
	} {
		if !strings.Contains(page, want) {
			t.Errorf("the report lacks %q", want)
		}
	}
}

func TestReportCaps(t *testing.T) {
	big := bytes.Repeat([]byte("0123456789abcdef"), 8<<10) // 128 KiB
	dir, _ := newExecLog(t, []string{"yes"}, execOut{"stdout", big, []int{len(big)}, []int64{1}})
	r := openReader(t, dir)
	sess, err := LoadSession(r, testSession)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := WriteReport(&buf, r, sess, ReportOptions{MaxOutput: 1000, MaxCast: 4000}); err != nil {
		t.Fatal(err)
	}
	page := pageWithoutPlayer(buf.String())
	if !strings.Contains(page, "[output cut at 1000 B a stream here") || !strings.Contains(page, "The terminal stops after") {
		t.Error("the caps are not stated")
	}
	if strings.Contains(page, string(big[:1001])) || !strings.Contains(page, string(big[:1000])) {
		t.Error("the text shown is not cut at the cap")
	}
	if len(page) > 40000 {
		t.Errorf("page of %d bytes", len(page))
	}
}

func itoa(n uint64) string { b, _ := json.Marshal(n); return string(b) }

func TestPlainText(t *testing.T) {
	for in, want := range map[string]string{
		"a\x1b[31mred\x1b[0m\r\nb": "ared\nb",
		"t\x1b]0;title\x07x":       "tx",
		"p\x1b]52;c;x\x1b\\q":      "pq",
		"progress\r50%\r100%\n":    "progress\n50%\n100%\n",
		"bell\x07\x00nul":          "bellnul",
		"bad \xff byte":            "bad \uFFFD byte",
		"\u009b6n":                 "6n",
	} {
		if got := plainText([]byte(in)); got != want {
			t.Errorf("plainText(%q) = %q, want %q", in, got, want)
		}
	}
}
