package protocol

import "testing"

func TestCleanText(t *testing.T) {
	for _, c := range []struct {
		in   string
		max  int
		want string
	}{
		{"plain", 10, "plain"},
		{"a\x00b\x1b[31m\xffc", 255, "ab[31mc"},
		{"tab\tnew\nline\r", 255, "tabnewline"},
		{"c1\u0085\u009bx\x7f", 255, "c1x"},
		{"long text", 4, "long"},
		{"ééé", 3, "é"}, // cut on a character boundary
		{"\x00\x00\x00abc", 3, "abc"},
		{"", 0, ""},
	} {
		if got := CleanText(c.in, c.max); got != c.want {
			t.Errorf("CleanText(%q, %d) = %q, want %q", c.in, c.max, got, c.want)
		}
	}
}
