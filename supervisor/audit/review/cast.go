package review

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// Caps on the output a cast carries; what follows the cap is left out,
// and the cast ends with a line saying how much.
const (
	DefaultCastMax = 256 << 20 // a cast file
	ReportCastMax  = 16 << 20  // the cast a report embeds
)

// CastOptions tune WriteCast.
type CastOptions struct {
	Width, Height int // the terminal; default 120x24
	Title         string
	// IdleTimeLimit, when set, goes in the header: players shorten longer
	// pauses to it. The event times stay as recorded.
	IdleTimeLimit time.Duration
	// MaxBytes caps the output included; default DefaultCastMax.
	MaxBytes int64
}

// CastStats says what WriteCast wrote.
type CastStats struct {
	Events   int
	Bytes    int64 // output bytes included
	Omitted  int64 // output bytes left out by the cap
	Start    time.Time
	Duration time.Duration
	// Markers are each command's start, for a player's chapter list.
	Markers []Marker
}

// Marker is a command's start in a cast.
type Marker struct {
	T     float64 // seconds from the start
	Label string
}

type castHeader struct {
	Version       int               `json:"version"`
	Width         int               `json:"width"`
	Height        int               `json:"height"`
	Timestamp     int64             `json:"timestamp"`
	IdleTimeLimit float64           `json:"idle_time_limit,omitempty"`
	Title         string            `json:"title,omitempty"`
	Env           map[string]string `json:"env,omitempty"`
}

// Prompts mark each command in a cast as a shell would: a green "$" and
// the command line on a line of its own.
//
// Output of commands run without a terminal has bare "\n" line ends,
// which need the terminal's new-line mode (LNM, CSI 20 h) to read as
// lines; a command with a terminal gets it reset (CSI 20 l), since
// full-screen programs move down with "\n". The cast switches the mode
// whenever the command whose output comes next needs the other one.
const (
	promptStart   = "\x1b[1;32m$\x1b[0m "
	newLineMode   = "\x1b[20h"
	lineFeedMode  = "\x1b[20l"
	castLineBreak = "\r\n"
)

// mode returns the escape that puts the terminal in the line mode a
// command needs, or "" when it is in it.
func (cw *castWriter) mode(tty bool) string {
	want := lnmOn
	if tty {
		want = lnmOff
	}
	if cw.lnm == want {
		return ""
	}
	cw.lnm = want
	if tty {
		return lineFeedMode
	}
	return newLineMode
}

type lnmState int

const (
	lnmUnknown lnmState = iota
	lnmOn
	lnmOff
)

func (cw *castWriter) prompt(c *Command) string {
	var b strings.Builder
	if !cw.atLineStart {
		b.WriteString(castLineBreak)
	}
	b.WriteString(cw.mode(c.TTY))
	b.WriteString(promptStart)
	b.WriteString(c.Line)
	b.WriteString(castLineBreak)
	return b.String()
}

// WriteCast writes the session's terminal as an asciicast v2 file
// (https://docs.asciinema.org/manual/asciicast/v2/): a header line, then
// one [time, "o", text] event per prompt and output chunk. Output is kept
// byte for byte, except that bytes that are not UTF-8 become U+FFFD; a
// character split between chunks is joined again.
func WriteCast(w io.Writer, dir string, s *Session, cmds []*Command, opts CastOptions) (CastStats, error) {
	if opts.Width <= 0 {
		opts.Width = 120
	}
	if opts.Height <= 0 {
		opts.Height = 24
	}
	if opts.MaxBytes <= 0 {
		opts.MaxBytes = DefaultCastMax
	}
	cw := &castWriter{w: bufio.NewWriterSize(w, 64<<10), atLineStart: true}
	var st CastStats
	pieces := terminalPieces(cmds)
	st.Start = s.Entries[0].Time
	if len(pieces) > 0 {
		st.Start = pieces[0].at
	}
	cw.start = st.Start
	hdr := castHeader{Version: 2, Width: opts.Width, Height: opts.Height, Timestamp: st.Start.Unix(),
		IdleTimeLimit: opts.IdleTimeLimit.Seconds(), Title: opts.Title, Env: map[string]string{"TERM": "xterm-256color"}}
	b, err := json.Marshal(hdr)
	if err != nil {
		return st, err
	}
	cw.w.Write(append(b, '\n'))
	total := OutputBytes(cmds)
	var last time.Time
	err = Terminal(dir, cmds, func(ev *Event) error {
		last = ev.At
		switch ev.Kind {
		case EventPrompt:
			st.Markers = append(st.Markers, Marker{T: cw.t(ev.At), Label: ev.Cmd.Line})
			return cw.event(ev.At, cw.prompt(ev.Cmd))
		case EventNote:
			return cw.note(ev.At, ev.Text)
		}
		if st.Bytes+int64(len(ev.Data)) > opts.MaxBytes {
			st.Omitted = total - st.Bytes
			return ErrStop
		}
		st.Bytes += int64(len(ev.Data))
		return cw.output(ev.At, ev.Cmd, streamKey{ev.Cmd.Seq, ev.Stream}, ev.Data)
	})
	if err != nil {
		return st, err
	}
	if err := cw.flushCarries(last); err != nil {
		return st, err
	}
	if st.Omitted > 0 {
		if err := cw.note(last, fmt.Sprintf("[carrel: the cast stops here: %s more output (of %s) is left out, over the cap of %s]",
			bytesText(st.Omitted), bytesText(total), bytesText(opts.MaxBytes))); err != nil {
			return st, err
		}
	}
	st.Events = cw.events
	if !last.IsZero() {
		st.Duration = last.Sub(st.Start)
	}
	return st, cw.w.Flush()
}

type streamKey struct {
	exec   uint64
	stream string
}

type castWriter struct {
	w           *bufio.Writer
	start       time.Time
	joiner      utf8Joiner
	lnm         lnmState
	atLineStart bool
	events      int
	text        bytes.Buffer
}

func (cw *castWriter) t(at time.Time) float64 { return max(at.Sub(cw.start).Seconds(), 0) }

// event writes [t, "o", text].
func (cw *castWriter) event(at time.Time, text string) error {
	if text == "" {
		return nil
	}
	cw.text.Reset()
	enc := json.NewEncoder(&cw.text)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(text); err != nil {
		return err
	}
	q := bytes.TrimSuffix(cw.text.Bytes(), []byte("\n"))
	cw.w.WriteByte('[')
	cw.w.WriteString(strconv.FormatFloat(cw.t(at), 'f', 6, 64))
	cw.w.WriteString(`, "o", `)
	cw.w.Write(q)
	_, err := cw.w.WriteString("]\n")
	cw.events++
	cw.atLineStart = text[len(text)-1] == '\n'
	return err
}

func (cw *castWriter) note(at time.Time, text string) error {
	s := "\x1b[7m" + text + "\x1b[0m" + castLineBreak
	if !cw.atLineStart {
		s = castLineBreak + s
	}
	return cw.event(at, s)
}

// output writes a chunk of one stream of command c.
func (cw *castWriter) output(at time.Time, c *Command, k streamKey, data []byte) error {
	text := bytes.ToValidUTF8(cw.joiner.join(k, data), []byte("\uFFFD"))
	if len(text) == 0 {
		return nil
	}
	return cw.event(at, cw.mode(c.TTY)+string(text))
}

// flushCarries writes what is left of cut sequences: they never
// completed, so they are not UTF-8.
func (cw *castWriter) flushCarries(at time.Time) error {
	for _, b := range cw.joiner.rest() {
		if err := cw.event(at, string(bytes.ToValidUTF8(b, []byte("\uFFFD")))); err != nil {
			return err
		}
	}
	return nil
}

// utf8Joiner keeps characters whole across chunks: it holds back a UTF-8
// sequence cut at the end of a stream's chunk until that stream's next
// chunk, so that neither a prompt nor another stream lands in the middle
// of it.
type utf8Joiner struct {
	carry map[streamKey][]byte
	order []streamKey
}

// join returns what of the stream's bytes so far can go out now.
func (j *utf8Joiner) join(k streamKey, data []byte) []byte {
	if j.carry == nil {
		j.carry = map[streamKey][]byte{}
	}
	prev, seen := j.carry[k]
	if !seen {
		j.order = append(j.order, k)
	}
	b := append(prev, data...)
	cut := len(b)
	for i := max(0, len(b)-utf8.UTFMax+1); i < len(b); i++ {
		if utf8.RuneStart(b[i]) && !utf8.FullRune(b[i:]) {
			cut = i
			break
		}
	}
	j.carry[k] = append(prev[:0:0], b[cut:]...)
	return b[:cut]
}

// rest returns, and forgets, the sequences still held back, which never
// completed.
func (j *utf8Joiner) rest() [][]byte {
	var out [][]byte
	for _, k := range j.order {
		if b := j.carry[k]; len(b) > 0 {
			out = append(out, b)
		}
	}
	j.carry, j.order = nil, nil
	return out
}
