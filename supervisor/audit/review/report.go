package review

import (
	"bytes"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"html/template"
	"io"
	"io/fs"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/supervisor/audit"
)

// The asciinema web player (Apache-2.0), vendored by
// assets/asciinema-player/fetch.sh; see VERSION there.
var (
	//go:embed assets/asciinema-player/asciinema-player.min.js
	playerJS string
	//go:embed assets/asciinema-player/asciinema-player.css
	playerCSS string
	//go:embed report.html.tmpl
	reportHTML string
)

// reportTmpl is parsed on first use: a program that links review but
// writes no report does not pay for it at start.
var reportTmpl = sync.OnceValue(func() *template.Template {
	return template.Must(template.New("report").Parse(reportHTML))
})

// ReportOptions tune WriteReport.
type ReportOptions struct {
	// Key is the verifier key the checkpoint must verify with; empty
	// means the log's key.pub (and the page says so).
	Key string
	// MaxOutput caps each command's stdout and stderr shown as text;
	// default 64 KiB. The embedded terminal has all of it, up to MaxCast.
	MaxOutput int64
	// MaxCast caps the output in the embedded terminal; default
	// ReportCastMax.
	MaxCast int64
	// IdleLimit shortens the terminal's longer pauses; default 3s.
	IdleLimit time.Duration
	// MaxPackages caps the image's packages listed; default 5000. The
	// page says how many it leaves out.
	MaxPackages int
	// Now is the report's time; default time.Now.
	Now func() time.Time
}

// WriteReport writes one self-contained HTML page about the session to
// w: whether its records are in the log's signed tree and its blobs
// intact, its decisions, its commands with their output, the files it
// touched, the image it ran on with its packages, its whole timeline, and
// a terminal player for its output. The page loads nothing from anywhere:
// the player, its styles and the recording are inline, and its
// Content-Security-Policy forbids the rest.
// Everything from the log goes through html/template's escaping.
func WriteReport(w io.Writer, r *audit.Reader, s *Session, opts ReportOptions) error {
	if opts.MaxOutput <= 0 {
		opts.MaxOutput = 64 << 10
	}
	if opts.MaxCast <= 0 {
		opts.MaxCast = ReportCastMax
	}
	if opts.IdleLimit <= 0 {
		opts.IdleLimit = 3 * time.Second
	}
	if opts.MaxPackages <= 0 {
		opts.MaxPackages = 5000
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	cmds := s.Commands()
	v := &reportView{
		Session: clean(s.ID, maxField), VM: clean(s.VM, maxField), Dir: r.Dir(),
		Generated: opts.Now().UTC().Format(timeLayout) + " UTC",
		Records:   len(s.Entries),
		First:     s.Entries[0].Time.UTC().Format(timeLayout), Last: s.Entries[len(s.Entries)-1].Time.UTC().Format(timeLayout),
		MaxOutput: bytesText(opts.MaxOutput), IdleLimit: opts.IdleLimit.String(), IdleSeconds: opts.IdleLimit.Seconds(),
		PlayerJS: template.JS(playerJS), PlayerCSS: template.CSS(playerCSS),
	}
	var m Manifest
	m.describe(s.Entries)
	v.ImageDigest = clean(m.ImageDigest, maxField)
	for _, p := range m.Policies {
		v.Policies = append(v.Policies, PolicyRef{clean(p.Name, maxField), clean(p.Revision, maxField)})
	}
	v.Image = newImageView(LoadImage(r, s), opts.MaxPackages)
	if s.End.TailBytes > 0 {
		v.TailNote = fmt.Sprintf("records.log ended in %d bytes that were not yet a whole record (an append in progress) when this page was made.", s.End.TailBytes)
	}
	v.Integrity = checkIntegrity(r, s, opts.Key)
	v.rows(s)
	if err := v.commands(r.Dir(), cmds, opts.MaxOutput); err != nil {
		return err
	}
	if len(cmds) > 0 {
		var cast bytes.Buffer
		st, err := WriteCast(&cast, r.Dir(), s, cmds, CastOptions{Title: "carrel session " + s.ID, MaxBytes: opts.MaxCast})
		if err != nil {
			return err
		}
		v.HasCast, v.Cast = true, cast.String()
		v.Markers = [][2]any{}
		for _, mk := range st.Markers {
			v.Markers = append(v.Markers, [2]any{mk.T, cutRunes(mk.Label, 80)})
		}
		if st.Omitted > 0 {
			v.CastNote = fmt.Sprintf("The terminal stops after %s of output: %s more is left out of this page (carrel audit replay --cast writes all of it).", bytesText(st.Bytes), bytesText(st.Omitted))
		}
	}
	return reportTmpl().Execute(w, v)
}

type reportView struct {
	Session, VM, Dir, Generated string
	ImageDigest                 string
	Image                       *imageView
	Policies                    []PolicyRef
	Records                     int
	First, Last                 string
	Integrity                   integrity
	Decisions                   []decisionRow
	Denied                      int
	Commands                    []commandRow
	Files                       []fileRow
	Timeline                    []timelineRow
	TailNote                    string
	MaxOutput                   string

	HasCast     bool
	Cast        string
	CastNote    string
	Markers     [][2]any
	IdleLimit   string
	IdleSeconds float64
	PlayerJS    template.JS
	PlayerCSS   template.CSS
}

// imageView is the report's Image section.
type imageView struct {
	*Image
	// RootHashText is the root hash, or why there is none.
	RootHashText string
	// Packages are the first of the image's packages; Total counts them
	// all, LeftOut those not listed.
	Packages       []manifest.Package
	Total, LeftOut int
}

func newImageView(img *Image, max int) *imageView {
	if img == nil {
		return nil
	}
	v := &imageView{Image: img, RootHashText: img.RootHash, Packages: img.Packages, Total: len(img.Packages)}
	switch {
	case v.RootHashText != "":
	case img.ManifestRead:
		v.RootHashText = "none: the image has no verified root file system"
	default:
		v.RootHashText = "not recorded"
	}
	if len(v.Packages) > max {
		v.Packages, v.LeftOut = v.Packages[:max], len(v.Packages)-max
	}
	return v
}

type integrity struct {
	OK       bool
	Lines    []string
	Problems []string
}

type decisionRow struct {
	Time                                string
	Seq                                 uint64
	Verdict, Kind, Rule, Reason, Policy string
	Cached                              bool
}

type commandRow struct {
	Seq                         uint64
	Time, Line, Exit, ExitClass string
	Duration                    string
	Cwd, User, Caller           string
	TTY, Open                   bool
	Stdout, Stderr              string
	Output                      []outputSpan
	Cut                         string
}

type outputSpan struct {
	Stderr bool
	Text   string
}

type fileRow struct {
	Time                           string
	Seq                            uint64
	Source, Op, Path, Size, Detail string
	Guest                          bool
}

type timelineRow struct {
	Time, Kind, Provenance, Summary string
	Seq                             uint64
	Guest                           bool
}

// checkIntegrity proves each of the session's records against the log's
// latest checkpoint and hashes each blob they reference.
func checkIntegrity(r *audit.Reader, s *Session, key string) integrity {
	var in integrity
	fail := func(format string, args ...any) { in.Problems = append(in.Problems, fmt.Sprintf(format, args...)) }
	keyNote := "with the key given"
	if key == "" {
		keyNote = "with the log's own key.pub, which proves less than a key kept apart from the log (pass --key)"
	}
	cp, err := r.LatestCheckpoint(key)
	switch {
	case err != nil:
		fail("the log's latest checkpoint cannot be used: %v; run carrel audit verify", err)
	case cp == nil:
		fail("the log has no signed checkpoint yet")
	default:
		in.Lines = append(in.Lines, fmt.Sprintf("The log's latest checkpoint, over its first %d records, verified %s.", cp.Size, keyNote))
		prover, err := r.Prover(cp)
		if err != nil {
			fail("the log does not match its checkpoint: %v", err)
			break
		}
		proven, unsigned := 0, 0
		for i := range s.Entries {
			e := &s.Entries[i]
			if e.Seq >= cp.Size {
				unsigned++
				continue
			}
			if _, err := prover.Prove(e.Seq, e.Payload); err != nil {
				fail("record %d: %v", e.Seq, err)
				break
			}
			proven++
		}
		prover.Close()
		if len(in.Problems) == 0 {
			in.Lines = append(in.Lines, fmt.Sprintf("All %d of this session's records up to it have inclusion proofs against it.", proven))
		}
		if unsigned > 0 {
			in.Lines = append(in.Lines, fmt.Sprintf("%d later records are not covered by a checkpoint yet: they are shown, but not proven.", unsigned))
		}
	}
	seen := map[string]bool{}
	var blobs, missing, replaced int
	for i := range s.Entries {
		for _, d := range s.Entries[i].Blobs {
			if seen[d] {
				continue
			}
			seen[d] = true
			blobs++
			switch err := hashBlob(r.Dir(), d); {
			case errors.Is(err, fs.ErrNotExist):
				missing++
				fail("blob %s (record %d) is missing", d, s.Entries[i].Seq)
			case err != nil:
				replaced++
				fail("blob %s (record %d): %v", d, s.Entries[i].Seq, err)
			}
		}
	}
	if missing+replaced == 0 {
		in.Lines = append(in.Lines, fmt.Sprintf("All %d blobs the records reference match their digests.", blobs))
	}
	in.Lines = append(in.Lines, "This checks this session's records only; carrel audit verify checks the whole log.")
	in.OK = len(in.Problems) == 0
	return in
}

func hashBlob(dir, digest string) error {
	path, err := audit.BlobPath(dir, digest)
	if err != nil {
		return err
	}
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return err
	}
	if got := "sha256:" + hex.EncodeToString(h.Sum(nil)); got != digest {
		return fmt.Errorf("its content hashes to %s: it was replaced", got)
	}
	return nil
}

// rows fills the decisions, files and timeline.
func (v *reportView) rows(s *Session) {
	f := func(x string) string { return clean(x, maxField) }
	for i := range s.Entries {
		e := &s.Entries[i]
		t := e.Time.UTC().Format(timeLayout)
		guest := e.Provenance == audit.Guest
		v.Timeline = append(v.Timeline, timelineRow{Time: t, Seq: e.Seq, Kind: f(e.Kind), Provenance: f(string(e.Provenance)), Summary: Summary(e), Guest: guest})
		source := "host"
		if guest {
			source = "guest"
		}
		switch e.Kind {
		case audit.KindPolicyDecision:
			var d audit.Decision
			if decodeData(e, &d) {
				row := decisionRow{Time: t, Seq: e.Seq, Verdict: verdict(d.Allow), Kind: f(d.Kind), Rule: f(d.Rule), Reason: clean(d.Reason, 1000), Policy: f(policyRef(d.Policy, d.Revision)), Cached: d.Cached}
				v.Decisions = append(v.Decisions, row)
				if !d.Allow {
					v.Denied++
				}
			}
		case audit.KindFileOp:
			var d audit.FileOp
			if decodeData(e, &d) {
				row := fileRow{Time: t, Seq: e.Seq, Source: source, Guest: guest, Op: f(d.Op), Path: clean(d.Path, 1000), Detail: f(d.Digest), Size: bytesText(d.Size)}
				if d.To != "" {
					row.Path += " → " + clean(d.To, 1000)
				}
				if d.Entries > 0 {
					row.Detail = fmt.Sprintf("%d entries %s", d.Entries, row.Detail)
				}
				if d.Content != "" {
					row.Detail += " (content not kept: " + f(d.Content) + ")"
				}
				if d.Error != "" {
					row.Detail = "error: " + f(d.Error)
				}
				v.Files = append(v.Files, row)
			}
		case audit.KindWatchEvent:
			var d audit.Watch
			if decodeData(e, &d) {
				for _, ev := range d.Events {
					row := fileRow{Time: t, Seq: e.Seq, Source: source + " (watch)", Guest: guest, Op: f(ev.Op), Path: clean(ev.Path, 1000)}
					if ev.OldPath != "" {
						row.Detail = "from " + clean(ev.OldPath, 1000)
					}
					v.Files = append(v.Files, row)
				}
				if d.Dropped > 0 {
					v.Files = append(v.Files, fileRow{Time: t, Seq: e.Seq, Source: source + " (watch)", Guest: guest, Op: "dropped", Detail: fmt.Sprintf("%d events were dropped", d.Dropped)})
				}
			}
		case audit.KindFileActivity:
			var d audit.Activity
			if decodeData(e, &d) {
				for _, ev := range d.Events {
					detail := fmt.Sprintf("pid %d", ev.PID)
					if ev.ExecID != "" {
						detail += " exec " + f(ev.ExecID)
					}
					v.Files = append(v.Files, fileRow{Time: t, Seq: e.Seq, Source: source + " (fanotify)", Guest: guest, Op: f(ev.Op), Path: clean(ev.Path, 1000), Detail: detail})
				}
				if d.Dropped > 0 {
					v.Files = append(v.Files, fileRow{Time: t, Seq: e.Seq, Source: source + " (fanotify)", Guest: guest, Op: "dropped", Detail: fmt.Sprintf("%d events were dropped", d.Dropped)})
				}
			}
		}
	}
}

// commands fills the command list, with each command's output as text.
func (v *reportView) commands(dir string, cmds []*Command, maxOut int64) error {
	for _, c := range cmds {
		row := commandRow{Seq: c.Seq, Time: c.Start.UTC().Format(timeLayout), Line: c.Line, Exit: c.ExitText(), ExitClass: "muted"}
		if c.intent != nil {
			row.Cwd, row.User, row.TTY = clean(c.intent.Cwd, 1000), clean(c.intent.User, maxField), c.intent.TTY
			row.Caller = callerText(&c.intent.Caller)
		}
		if c.exit != nil {
			row.Stdout, row.Stderr = bytesText(c.exit.StdoutBytes), bytesText(c.exit.StderrBytes)
			if c.exit.Code != nil && *c.exit.Code == 0 {
				row.ExitClass = "allow"
			} else {
				row.ExitClass = "deny"
			}
		} else {
			var out, errb int64
			for _, o := range c.outputs {
				switch o.stream {
				case "stdout":
					out += o.size
				case "stderr":
					errb += o.size
				}
			}
			row.Stdout, row.Stderr = bytesText(out), bytesText(errb)
		}
		if c.Exit != nil {
			row.Duration = c.Exit.Time.Sub(c.Start).Round(time.Millisecond).String()
		} else {
			row.Duration = "no outcome"
		}
		// The output, a stream's consecutive pieces joined so that a
		// character split between chunks stays whole.
		var spans []outputSpan
		var cur bytes.Buffer
		curStream := ""
		shown := map[string]int64{}
		cut := map[string]bool{}
		flush := func() {
			if cur.Len() > 0 {
				spans = append(spans, outputSpan{Stderr: curStream == "stderr", Text: plainText(cur.Bytes())})
				cur.Reset()
			}
		}
		err := Terminal(dir, []*Command{c}, func(ev *Event) error {
			switch ev.Kind {
			case EventNote:
				flush()
				spans = append(spans, outputSpan{Stderr: true, Text: "\n" + ev.Text + "\n"})
				return nil
			case EventPrompt:
				return nil
			}
			room := maxOut - shown[ev.Stream]
			if room <= 0 {
				cut[ev.Stream] = true
				if cut["stdout"] && cut["stderr"] {
					return ErrStop
				}
				return nil
			}
			data := ev.Data
			if int64(len(data)) > room {
				data, cut[ev.Stream] = data[:room], true
			}
			shown[ev.Stream] += int64(len(data))
			if ev.Stream != curStream {
				flush()
				curStream = ev.Stream
			}
			cur.Write(data)
			return nil
		})
		if err != nil {
			return err
		}
		flush()
		row.Output = spans
		if cut["stdout"] || cut["stderr"] {
			row.Cut = fmt.Sprintf("[output cut at %s a stream here; the terminal player and carrel audit replay have all of it]", bytesText(maxOut))
		}
		row.Open = len(cmds) <= 20
		v.Commands = append(v.Commands, row)
	}
	return nil
}

// plainText is terminal output as text to read: escape sequences and
// control characters other than newline and tab are left out, carriage
// returns before newlines dropped, and bytes that are not UTF-8 shown as
// U+FFFD.
func plainText(b []byte) string {
	b = bytes.ToValidUTF8(b, []byte("\uFFFD"))
	var out strings.Builder
	for i := 0; i < len(b); i++ {
		c := b[i]
		switch {
		case c == 0x1b:
			i = skipEscape(b, i)
		case c == '\r':
			if i+1 < len(b) && b[i+1] == '\n' {
				continue
			}
			out.WriteByte('\n')
		case c == '\n' || c == '\t':
			out.WriteByte(c)
		case c < 0x20 || c == 0x7f:
		case c == 0xc2 && i+1 < len(b) && b[i+1] >= 0x80 && b[i+1] <= 0x9f:
			i++ // a C1 control
		default:
			out.WriteByte(c)
		}
	}
	return out.String()
}

// skipEscape returns the index of the last byte of the escape sequence
// starting at b[i] (an ESC).
func skipEscape(b []byte, i int) int {
	if i+1 >= len(b) {
		return i
	}
	j := i + 1
	switch b[j] {
	case '[':
		for j++; j < len(b); j++ {
			if b[j] >= 0x40 && b[j] <= 0x7e {
				return j
			}
		}
		return len(b) - 1
	case ']', 'P', 'X', '^', '_':
		for j++; j < len(b); j++ {
			if b[j] == 0x07 {
				return j
			}
			if b[j] == 0x1b && j+1 < len(b) && b[j+1] == '\\' {
				return j + 1
			}
		}
		return len(b) - 1
	}
	for ; j < len(b) && b[j] >= 0x20 && b[j] <= 0x2f; j++ {
	}
	if j < len(b) {
		return j
	}
	return len(b) - 1
}

func cutRunes(s string, n int) string {
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	return string(r[:n]) + "…"
}
