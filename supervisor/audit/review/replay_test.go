package review

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

func TestReplay(t *testing.T) {
	s := newSampleLog(t)
	r, sess := loadSample(t, s)
	var sleeps []time.Duration
	sleep := func(_ context.Context, d time.Duration) error {
		sleeps = append(sleeps, d)
		return nil
	}
	var raw bytes.Buffer
	if err := Replay(context.Background(), &raw, r.Dir(), sess.Commands(), ReplayOptions{Speed: 2, MaxIdle: 10 * time.Second, Raw: true, Sleep: sleep}); err != nil {
		t.Fatal(err)
	}
	out := raw.String()
	for _, want := range []string{"$ echo 'héllo wörld ✓'\n", string(s.scriptErr), "$ sleep 1\n"} {
		if !strings.Contains(out, want) {
			t.Errorf("replay lacks %q:\n%q", want, out)
		}
	}
	// Raw, every byte recorded is there, in each stream's order.
	for _, b := range [][]byte{s.echoOut, s.scriptOut} {
		if !containsInOrder(out, string(b)) {
			t.Errorf("replay lacks the bytes %q in order:\n%q", b, out)
		}
	}
	// The script's stderr comes 20s after it starts and its last stdout
	// 40s after that: both pauses are capped at 10s, then halved.
	var capped int
	var total time.Duration
	for _, d := range sleeps {
		if d > 5*time.Second {
			t.Errorf("sleep %v over the cap", d)
		}
		if d == 5*time.Second {
			capped++
		}
		total += d
	}
	if capped != 2 || total < 10*time.Second || total > 11*time.Second {
		t.Errorf("sleeps %v: %d capped, %v in all", sleeps, capped, total)
	}

	// Filtered (the default), the clipboard write and the status query
	// are gone; colours stay.
	var filtered bytes.Buffer
	if err := Replay(context.Background(), &filtered, r.Dir(), sess.Commands(), ReplayOptions{Speed: 1e9, Sleep: sleep}); err != nil {
		t.Fatal(err)
	}
	f := filtered.String()
	if strings.Contains(f, "\x1b]52") || strings.Contains(f, "ZXZpbA==") || strings.Contains(f, "\x1b[6n") {
		t.Errorf("filtered replay passes a clipboard write or a query: %q", f)
	}
	if !strings.Contains(f, "ert(1)</script>\n\x1b[31mred\x1b[0m\n") || !strings.Contains(f, "héllo wörld ") || !strings.Contains(f, "✓\n") {
		t.Errorf("filtered replay lost ordinary output: %q", f)
	}
	// The prompt's command line is escaped: the title sequence in argv
	// does not reach the terminal.
	if strings.Contains(f, "\x1b]0;title") || !strings.Contains(f, `$ sh -c $'printf \'<script>\'\x1b]0;title\a'`) {
		t.Errorf("prompt line not escaped: %q", f)
	}

	// A cancelled replay stops.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := Replay(ctx, &bytes.Buffer{}, r.Dir(), sess.Commands(), ReplayOptions{}); err == nil {
		t.Error("cancelled replay ran to the end")
	}
}

// containsInOrder reports whether the bytes of sub appear in s in order
// (other text may come between them).
func containsInOrder(s, sub string) bool {
	i := 0
	for j := 0; j < len(s) && i < len(sub); j++ {
		if s[j] == sub[i] {
			i++
		}
	}
	return i == len(sub)
}

func TestTermFilter(t *testing.T) {
	for _, tc := range []struct{ name, in, want string }{
		{"plain", "hello\r\nworld\n", "hello\r\nworld\n"},
		{"colour and cursor", "\x1b[1;31mred\x1b[0m\x1b[2J\x1b[H\x1b[?25l", "\x1b[1;31mred\x1b[0m\x1b[2J\x1b[H\x1b[?25l"},
		{"charset", "\x1b(Bx\x1b)0", "\x1b(Bx\x1b)0"},
		{"title, BEL", "a\x1b]0;pwned\x07b", "ab"},
		{"clipboard, ST", "a\x1b]52;c;ZXZpbA==\x1b\\b", "ab"},
		{"hyperlink", "\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\", "link"},
		{"DCS", "a\x1bP+q544e\x1b\\b", "ab"},
		{"APC PM SOS", "\x1b_x\x1b\\\x1b^y\x1b\\\x1bXz\x1b\\ok", "ok"},
		{"status report", "a\x1b[6nb\x1b[5n", "ab"},
		{"device attributes", "\x1b[c\x1b[>c\x1b[=c\x1bZok", "ok"},
		{"window ops", "\x1b[21t\x1b[8;50;100tok", "ok"},
		{"mode request", "\x1b[?2026$pok", "ok"},
		{"xtversion", "\x1b[>0qok", "ok"},
		{"cursor style stays", "\x1b[2 q", "\x1b[2 q"},
		{"ENQ", "a\x05b", "ab"},
		{"C1 as UTF-8", "a\u009b6nb\u009d0;x\x07", "a6nb0;x\x07"},
		{"stray C1 byte", "a\x9b6n", "a6n"},
		{"UTF-8 with C1-like continuations", "❐ é ✓ 🎉", "❐ é ✓ 🎉"},
		{"cancelled sequence", "\x1b[12\x18ok", "ok"},
		{"control inside CSI", "\x1b[1\n;31mx", "\n\x1b[1;31mx"},
		{"overlong CSI", "\x1b[" + strings.Repeat("1;", 100) + "mok", "ok"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Whole, and cut at every byte: the state carries over.
			for _, step := range []int{len(tc.in), 1, 2, 3} {
				var b bytes.Buffer
				f := newTermFilter(&b)
				for i := 0; i < len(tc.in); i += step {
					f.Write([]byte(tc.in[i:min(i+step, len(tc.in))]))
				}
				if b.String() != tc.want {
					t.Errorf("step %d: %q -> %q, want %q", step, tc.in, b.String(), tc.want)
				}
			}
		})
	}
}
