package console

import (
	"testing"
	"unicode/utf8"
)

func TestPrintable(t *testing.T) {
	for in, want := range map[string]string{
		"plain text\n\tindented":                  "plain text\n\tindented",
		"\x1b[31mred\x1b[0m\r\n":                  "red\n",
		"\x1b]0;title\x07after":                   "after",
		"\x1b]52;c;ZXZpbA==\x1b\\clipboard":       "clipboard",
		"bell\x07 nul\x00 del\x7f c1\u009b end":   "bell nul del c1 end",
		"\x1bcreset":                              "reset",
		"héllo \xff\xfe wörld":                    "héllo \ufffd\ufffd wörld",
		"cut CSI \x1b[12":                         "cut CSI ",
		"cut OSC \x1b]0;never ends":               "cut OSC ",
		"ends with ESC\x1b":                       "ends with ESC",
		"[    0.000000] Linux version 6.1.0-28\n": "[    0.000000] Linux version 6.1.0-28\n",
	} {
		if got := Printable([]byte(in)); got != want {
			t.Errorf("Printable(%q) = %q, want %q", in, got, want)
		}
	}
}

// FuzzPrintable: whatever the guest prints comes out as valid UTF-8 with
// no control character but newline and tab.
func FuzzPrintable(f *testing.F) {
	f.Add([]byte("\x1b[31mred\x1b[0m\r\n"))
	f.Add([]byte("\x1b]0;t\x07\xff\x00"))
	f.Fuzz(func(t *testing.T, b []byte) {
		s := Printable(b)
		if !utf8.ValidString(s) {
			t.Fatalf("%q: not UTF-8", s)
		}
		for _, r := range s {
			if (r < 0x20 && r != '\n' && r != '\t') || (r >= 0x7f && r < 0xa0) {
				t.Fatalf("%q: control character %U", s, r)
			}
		}
	})
}
