package console

import (
	"strings"
	"unicode/utf8"
)

// Printable is what the guest printed on its console, safe to show on a
// terminal or to hand to a model: valid UTF-8, with terminal escape
// sequences (CSI, OSC and two-byte ones) and every other control
// character but newline and tab taken out, and bytes that are not UTF-8
// replaced by U+FFFD.
func Printable(b []byte) string {
	var out strings.Builder
	out.Grow(len(b))
	for i := 0; i < len(b); {
		c := b[i]
		if c == 0x1b {
			i = skipEscape(b, i)
			continue
		}
		r, n := utf8.DecodeRune(b[i:])
		i += n
		switch {
		case r == utf8.RuneError && n == 1:
			out.WriteRune(utf8.RuneError)
		case r == '\n' || r == '\t':
			out.WriteRune(r)
		case r < 0x20 || (r >= 0x7f && r < 0xa0):
			// C0 and C1 controls, DEL: dropped.
		default:
			out.WriteRune(r)
		}
	}
	return out.String()
}

// skipEscape returns the index after the escape sequence starting at
// b[i] (an ESC): CSI (ESC [ ... final byte), OSC (ESC ] ... BEL or ESC \),
// or ESC and one more byte. One that does not end runs to the end of b.
func skipEscape(b []byte, i int) int {
	if i+1 >= len(b) {
		return len(b)
	}
	switch b[i+1] {
	case '[':
		for j := i + 2; j < len(b); j++ {
			if b[j] >= 0x40 && b[j] <= 0x7e {
				return j + 1
			}
		}
		return len(b)
	case ']':
		for j := i + 2; j < len(b); j++ {
			if b[j] == 0x07 {
				return j + 1
			}
			if b[j] == 0x1b && j+1 < len(b) && b[j+1] == '\\' {
				return j + 2
			}
		}
		return len(b)
	}
	return i + 2
}
