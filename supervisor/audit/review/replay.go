package review

import (
	"context"
	"io"
	"time"
)

// ReplayOptions tune Replay.
type ReplayOptions struct {
	// Speed divides the pauses between events; default 1 (real time).
	Speed float64
	// MaxIdle caps each pause, before Speed divides it; 0 means no cap.
	MaxIdle time.Duration
	// Raw writes the guest's output as it is. Otherwise escape sequences
	// that reach beyond the screen are dropped (see termFilter): the
	// output is a hostile guest's, and the terminal is the reviewer's.
	Raw bool
	// Color draws the prompt's "$" in bold green.
	Color bool
	// Sleep waits; default a timer on ctx. Tests replace it.
	Sleep func(context.Context, time.Duration) error
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Replay plays the commands' terminal to w as it happened: a "$ command"
// line when each starts, then its stdout and stderr, with the pauses
// between them as recorded (divided by Speed, capped by MaxIdle).
func Replay(ctx context.Context, w io.Writer, dir string, cmds []*Command, opts ReplayOptions) error {
	if opts.Speed <= 0 {
		opts.Speed = 1
	}
	if opts.Sleep == nil {
		opts.Sleep = sleepCtx
	}
	streams := map[streamKey]io.Writer{}
	out := func(k streamKey) io.Writer {
		if opts.Raw {
			return w
		}
		f, ok := streams[k]
		if !ok {
			f = newTermFilter(w)
			streams[k] = f
		}
		return f
	}
	var prev time.Time
	var joiner utf8Joiner
	atLineStart := true
	write := func(b []byte) error {
		if len(b) == 0 {
			return nil
		}
		atLineStart = b[len(b)-1] == '\n'
		_, err := w.Write(b)
		return err
	}
	err := Terminal(dir, cmds, func(ev *Event) error {
		if !prev.IsZero() {
			gap := ev.At.Sub(prev)
			if opts.MaxIdle > 0 && gap > opts.MaxIdle {
				gap = opts.MaxIdle
			}
			if gap = time.Duration(float64(gap) / opts.Speed); gap > 0 {
				if err := opts.Sleep(ctx, gap); err != nil {
					return err
				}
			}
		}
		prev = ev.At
		switch ev.Kind {
		case EventPrompt:
			p := "$ "
			if opts.Color {
				p = promptStart
			}
			if !atLineStart {
				p = "\n" + p
			}
			return write([]byte(p + ev.Cmd.Line + "\n"))
		case EventNote:
			s := ev.Text + "\n"
			if !atLineStart {
				s = "\n" + s
			}
			return write([]byte(s))
		}
		k := streamKey{ev.Cmd.Seq, ev.Stream}
		b := joiner.join(k, ev.Data)
		if len(b) == 0 {
			return nil
		}
		atLineStart = b[len(b)-1] == '\n'
		_, err := out(k).Write(b)
		return err
	})
	if err != nil {
		return err
	}
	for _, b := range joiner.rest() {
		if _, err := w.Write(b); err != nil {
			return err
		}
	}
	return nil
}
