package protocol

import (
	"strings"
	"unicode"
	"unicode/utf8"
)

// CleanText makes text that came from the other side (a guest's error, a
// host name, a process's command line) safe to log, record and show: bytes
// that are not UTF-8 and control characters (C0, DEL, C1) are dropped, and
// what is left is cut to at most max bytes, on a character boundary.
func CleanText(s string, max int) string {
	s = strings.Map(func(r rune) rune {
		if r == utf8.RuneError || unicode.IsControl(r) {
			return -1
		}
		return r
	}, strings.ToValidUTF8(s, ""))
	if len(s) <= max {
		return s
	}
	return strings.ToValidUTF8(s[:max], "")
}
