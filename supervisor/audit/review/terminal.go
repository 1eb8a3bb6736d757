package review

import (
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"time"

	"github.com/carrel-os/carrel/supervisor/audit"
)

// Command is one exec of a session: its intent, its outcome and the
// records of its output.
type Command struct {
	Seq   uint64    // the intent's seq
	Start time.Time // the intent's time; output chunk times count from it
	// Line is the command line, safe to print; Argv is as recorded.
	Line   string
	Argv   []string
	TTY    bool
	intent *execCommand
	// Exit is its exec.exit (or action.outcome) record, nil while it runs.
	Exit    *Entry
	exit    *audit.ExecExit
	outputs []*outputRef
}

// ExitText says how the command ended.
func (c *Command) ExitText() string {
	switch {
	case c.exit != nil:
		return exitText(c.exit)
	case c.Exit != nil:
		return Summary(c.Exit)
	}
	return "no outcome recorded (still running, or the log ends here)"
}

type outputRef struct {
	entry  *Entry
	stream string
	size   int64
	blob   string
	chunks [][2]int64
}

// Commands returns the session's exec commands, in the order of their
// intents, each with its outcome and output records. An output record
// whose intent is not among the session's records gets a command of its
// own, timed by the record.
func (s *Session) Commands() []*Command {
	var cmds []*Command
	bySeq := map[uint64]*Command{}
	for i := range s.Entries {
		e := &s.Entries[i]
		if d := execIntent(e); d != nil {
			c := &Command{Seq: e.Seq, Start: e.Time, intent: d, Line: commandLine(d, -1), Argv: d.Argv, TTY: d.TTY}
			cmds = append(cmds, c)
			bySeq[e.Seq] = c
			continue
		}
		switch {
		case e.Intent != nil && (e.Kind == audit.KindExecExit || e.Kind == audit.KindOutcome):
			if c := bySeq[*e.Intent]; c != nil && c.Exit == nil {
				c.Exit = e
				if e.Kind == audit.KindExecExit {
					var d audit.ExecExit
					if decodeData(e, &d) {
						c.exit = &d
					}
				}
			}
		case e.Kind == audit.KindExecOutput:
			var d audit.ExecOutput
			if !decodeData(e, &d) || len(e.Blobs) == 0 || d.Size <= 0 {
				continue
			}
			if d.Stream != "stdout" && d.Stream != "stderr" && d.Stream != "stdin" {
				continue
			}
			c := bySeq[d.Exec]
			if c == nil {
				c = &Command{Seq: d.Exec, Start: e.Time, Line: fmt.Sprintf("(exec %d, whose intent is not in this session)", d.Exec)}
				if len(d.Chunks) > 0 {
					c.Start = e.Time.Add(-time.Duration(d.Chunks[0][0]))
				}
				cmds = append(cmds, c)
				bySeq[d.Exec] = c
			}
			c.outputs = append(c.outputs, &outputRef{entry: e, stream: d.Stream, size: d.Size, blob: e.Blobs[0], chunks: d.Chunks})
		}
	}
	return cmds
}

// EventKind says what an Event is.
type EventKind int

const (
	// EventPrompt is a command starting: Cmd says which.
	EventPrompt EventKind = iota
	// EventOutput is bytes a command wrote to Stream.
	EventOutput
	// EventNote is something the reader must know, in Text: output that
	// is missing or cut.
	EventNote
)

// Event is one step of a session's terminal.
type Event struct {
	At     time.Time
	Kind   EventKind
	Cmd    *Command
	Stream string // "stdout" or "stderr"
	Data   []byte // output, valid during the call
	Text   string // a note, safe to print
}

// piece is a prompt or a run of one output chunk.
type piece struct {
	at       time.Time
	seq, idx uint64 // ties in time keep record order
	cmd      *Command
	out      *outputRef // nil for a prompt
	off, n   int64      // the bytes in the blob
}

// readPiece caps what one Event carries.
const readPiece = 32 << 10

// ErrStop, returned by a Terminal callback, stops it without error.
var ErrStop = errors.New("stop")

// Terminal walks a session's terminal, its Commands, in time order: each
// command's prompt at its start, and its stdout and stderr chunks, each
// at its command's start plus the chunk's offset. Output is read from the
// blobs of the log in dir a piece at a time; output that cannot be read
// becomes a note. Standard input is not shown.
func Terminal(dir string, cmds []*Command, fn func(*Event) error) error {
	pieces := terminalPieces(cmds)
	blobs := newBlobCache(dir)
	defer blobs.close()
	buf := make([]byte, readPiece)
	noted := map[*outputRef]bool{}
	for _, p := range pieces {
		if p.out == nil {
			if err := fn(&Event{At: p.at, Kind: EventPrompt, Cmd: p.cmd}); err != nil {
				return stopped(err)
			}
			continue
		}
		for done := int64(0); done < p.n; {
			k := min(int64(len(buf)), p.n-done)
			got, err := blobs.readAt(p.out.blob, buf[:k], p.off+done)
			if got > 0 {
				if err := fn(&Event{At: p.at, Kind: EventOutput, Cmd: p.cmd, Stream: p.out.stream, Data: buf[:got]}); err != nil {
					return stopped(err)
				}
				done += int64(got)
			}
			if err != nil {
				if !noted[p.out] {
					noted[p.out] = true
					note := fmt.Sprintf("[carrel: %s of exec %d's %s, recorded by record %d, cannot be read: %v]",
						bytesText(p.out.size), p.cmd.Seq, p.out.stream, p.out.entry.Seq, err)
					if err := fn(&Event{At: p.at, Kind: EventNote, Cmd: p.cmd, Text: clean(note, -1)}); err != nil {
						return stopped(err)
					}
				}
				break
			}
		}
	}
	return nil
}

func stopped(err error) error {
	if errors.Is(err, ErrStop) {
		return nil
	}
	return err
}

// terminalPieces lays out the prompts and output chunks of cmds in time
// order. Chunk times within one stream never go backwards: a chunk timed
// before the one it follows is moved up to it.
func terminalPieces(cmds []*Command) []piece {
	var ps []piece
	for _, c := range cmds {
		if c.intent != nil {
			ps = append(ps, piece{at: c.Start, seq: c.Seq, cmd: c})
		}
		last := map[string]time.Time{}
		for _, o := range c.outputs {
			if o.stream == "stdin" {
				continue
			}
			chunks := o.chunks
			if len(chunks) == 0 {
				chunks = [][2]int64{{int64(o.entry.Time.Sub(c.Start)), o.size}}
			}
			var off int64
			for i, ch := range chunks {
				n := min(max(ch[1], 0), o.size-off)
				if n <= 0 {
					continue
				}
				at := c.Start.Add(time.Duration(max(ch[0], 0)))
				if at.Before(last[o.stream]) {
					at = last[o.stream]
				}
				last[o.stream] = at
				ps = append(ps, piece{at: at, seq: o.entry.Seq, idx: uint64(i) + 1, cmd: c, out: o, off: off, n: n})
				off += n
			}
			if off < o.size {
				// Chunks that account for less than the record's size:
				// the rest goes with the last of them.
				at := last[o.stream]
				if at.IsZero() {
					at = o.entry.Time
				}
				ps = append(ps, piece{at: at, seq: o.entry.Seq, idx: uint64(len(chunks)) + 1, cmd: c, out: o, off: off, n: o.size - off})
			}
		}
	}
	slices.SortStableFunc(ps, func(a, b piece) int {
		if c := a.at.Compare(b.at); c != 0 {
			return c
		}
		if a.seq != b.seq {
			if a.seq < b.seq {
				return -1
			}
			return 1
		}
		if a.idx < b.idx {
			return -1
		}
		if a.idx > b.idx {
			return 1
		}
		return 0
	})
	return ps
}

// OutputBytes is how many bytes of stdout and stderr the commands'
// records hold.
func OutputBytes(cmds []*Command) int64 {
	var n int64
	for _, c := range cmds {
		for _, o := range c.outputs {
			if o.stream != "stdin" {
				n += o.size
			}
		}
	}
	return n
}

// blobCache keeps a few blob files open for reading pieces of them.
type blobCache struct {
	dir   string
	files map[string]*os.File
	order []string
}

const maxOpenBlobs = 32

func newBlobCache(dir string) *blobCache {
	return &blobCache{dir: dir, files: map[string]*os.File{}}
}

func (c *blobCache) readAt(digest string, p []byte, off int64) (int, error) {
	f, ok := c.files[digest]
	if !ok {
		path, err := audit.BlobPath(c.dir, digest)
		if err != nil {
			return 0, err
		}
		if f, err = os.Open(path); err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return 0, fmt.Errorf("blob %s is missing", digest)
			}
			return 0, err
		}
		if len(c.order) == maxOpenBlobs {
			c.files[c.order[0]].Close()
			delete(c.files, c.order[0])
			c.order = c.order[1:]
		}
		c.files[digest] = f
		c.order = append(c.order, digest)
	}
	n, err := f.ReadAt(p, off)
	if errors.Is(err, io.EOF) {
		if n == len(p) {
			return n, nil
		}
		return n, fmt.Errorf("blob %s ends at %d bytes: shorter than its record says", digest, off+int64(n))
	}
	return n, err
}

func (c *blobCache) close() {
	for _, f := range c.files {
		f.Close()
	}
}
