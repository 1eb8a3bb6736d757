package review

import (
	"bytes"
	"io"
)

// termFilter passes a guest's terminal output on to a reviewer's
// terminal without the escape sequences that reach beyond the screen:
// OSC, DCS, SOS, PM and APC strings (window titles, the clipboard, file
// transfers), C1 controls, ENQ, and the CSI and ESC sequences that make a
// terminal answer (device status, device attributes, mode and window
// reports), whose answer would land in the reviewer's shell as typed
// input. Colours, cursor movement and erasing pass unchanged. It keeps
// its state across writes, since a sequence may be split between chunks.
type termFilter struct {
	w     io.Writer
	state filterState
	held  []byte // the sequence being read
	cont  int    // UTF-8 continuation bytes due
	out   []byte
}

type filterState int

const (
	fGround filterState = iota
	fEsc
	fEscInter
	fCSI
	fCSIDrop // a CSI sequence too long to hold: dropped whole
	fString
	fStringEsc
	fC2 // 0xC2 seen: a C1 control follows, or a character
)

const maxHeld = 64

func newTermFilter(w io.Writer) *termFilter { return &termFilter{w: w} }

func (f *termFilter) Write(p []byte) (int, error) {
	f.out = f.out[:0]
	for _, b := range p {
		f.step(b)
	}
	if len(f.out) > 0 {
		if _, err := f.w.Write(f.out); err != nil {
			return 0, err
		}
	}
	return len(p), nil
}

func (f *termFilter) pass(b ...byte) { f.out = append(f.out, b...) }

func (f *termFilter) toGround() { f.state, f.held = fGround, f.held[:0] }

func (f *termFilter) step(b byte) {
	switch f.state {
	case fGround:
		f.ground(b)
	case fC2:
		f.state = fGround
		if 0x80 <= b && b <= 0x9f {
			f.cont = 0
			return // C1 control as UTF-8: dropped
		}
		f.pass(0xc2)
		f.ground(b)
	case fEsc:
		switch {
		case b == '[':
			f.held, f.state = append(f.held, b), fCSI
		case b == ']' || b == 'P' || b == 'X' || b == '^' || b == '_':
			f.held, f.state = f.held[:0], fString
		case b == 'Z': // DECID: the terminal answers
			f.toGround()
		case 0x20 <= b && b <= 0x2f:
			f.held, f.state = append(f.held, b), fEscInter
		case 0x30 <= b && b <= 0x7e:
			f.pass(f.held...)
			f.pass(b)
			f.toGround()
		case b == 0x1b:
			f.held = append(f.held[:0], b)
		case b == 0x18 || b == 0x1a:
			f.toGround()
		case b < 0x20:
			f.control(b) // executed within the sequence
		default:
			f.toGround()
			f.ground(b)
		}
	case fEscInter:
		switch {
		case 0x20 <= b && b <= 0x2f && len(f.held) < maxHeld:
			f.held = append(f.held, b)
		case 0x30 <= b && b <= 0x7e:
			f.pass(f.held...)
			f.pass(b)
			f.toGround()
		default:
			f.toGround()
			if b != 0x18 && b != 0x1a {
				f.ground(b)
			}
		}
	case fCSI, fCSIDrop:
		switch {
		case 0x20 <= b && b <= 0x3f:
			if f.state == fCSI && len(f.held) < maxHeld {
				f.held = append(f.held, b)
			} else {
				f.state = fCSIDrop
			}
		case 0x40 <= b && b <= 0x7e:
			if f.state == fCSI && csiAllowed(f.held[2:], b) {
				f.pass(f.held...)
				f.pass(b)
			}
			f.toGround()
		case b == 0x1b:
			f.held, f.state = append(f.held[:0], b), fEsc
		case b == 0x18 || b == 0x1a:
			f.toGround()
		case b < 0x20:
			f.control(b)
		default:
			f.toGround()
			f.ground(b)
		}
	case fString:
		switch b {
		case 0x07, 0x18, 0x1a:
			f.toGround()
		case 0x1b:
			f.state = fStringEsc
		}
	case fStringEsc:
		if b == '\\' {
			f.toGround()
			return
		}
		f.held, f.state = append(f.held[:0], 0x1b), fEsc
		f.step(b)
	}
}

// control passes a C0 control met within a sequence, as terminals
// execute it there, except ENQ.
func (f *termFilter) control(b byte) {
	if b != 0x05 {
		f.pass(b)
	}
}

func (f *termFilter) ground(b byte) {
	switch {
	case b == 0x1b:
		f.held, f.state, f.cont = append(f.held[:0], b), fEsc, 0
	case b == 0x05: // ENQ: the terminal sends its answerback
	case f.cont > 0 && 0x80 <= b && b <= 0xbf:
		f.cont--
		f.pass(b)
	case b == 0xc2:
		f.state, f.cont = fC2, 1
	case 0x80 <= b && b <= 0x9f:
		f.cont = 0 // a stray byte an 8-bit terminal reads as C1: dropped
	default:
		switch {
		case 0xc3 <= b && b <= 0xdf:
			f.cont = 1
		case 0xe0 <= b && b <= 0xef:
			f.cont = 2
		case 0xf0 <= b && b <= 0xf4:
			f.cont = 3
		default:
			f.cont = 0
		}
		f.pass(b)
	}
}

// csiAllowed reports whether a CSI sequence with these parameter and
// intermediate bytes and this final byte leaves the terminal silent.
func csiAllowed(params []byte, final byte) bool {
	var private byte
	if len(params) > 0 && params[0] >= '<' && params[0] <= '?' {
		private = params[0]
	}
	switch {
	case final == 'c', final == 'n', final == 'x', final == 't':
		return false // device attributes, status, parameters, window ops
	case final == 'p' && bytes.IndexByte(params, '$') >= 0:
		return false // DECRQM
	case final == 'q' && private == '>':
		return false // XTVERSION
	case final == 'u' && private == '?':
		return false // keyboard protocol query
	case final == 'S' && private == '?':
		return false // XTSMGRAPHICS
	case final == '|' && bytes.IndexByte(params, '\'') >= 0:
		return false // DECRQLP
	}
	return true
}
