package tests

import (
	"bufio"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/tests/harness"
)

// TestAuditReview records a real VM session, then reviews it as a
// compliance reviewer would: the timeline, a replay as an asciinema cast,
// a rerun on a fresh VM that finds the one command whose output cannot
// repeat, and an evidence bundle verified offline from a copy, with the
// key kept apart. A bundle with one byte changed fails.
func TestAuditReview(t *testing.T) {
	d := harness.New(t)
	d.Start()
	d.BuildImage()
	dir := filepath.Join(d.State, "audit")
	key := strings.TrimSpace(d.Must("audit", "key", "--dir", dir))
	d.Must("vm", "create", "rev", "--memory", "256M")
	var vm struct {
		Session string `json:"session"`
	}
	if err := json.Unmarshal([]byte(d.Must("vm", "inspect", "rev")), &vm); err != nil {
		t.Fatal(err)
	}
	session := vm.Session
	if !strings.HasPrefix(session, "ses_") {
		t.Fatalf("session %q", session)
	}
	d.Must("exec", "rev", "--", "sh", "-c", "echo hello from carrel; echo to stderr >&2")
	in := filepath.Join(t.TempDir(), "in.txt")
	if err := os.WriteFile(in, []byte("recorded input\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	d.Must("cp", in, "rev:/workspace/in.txt")
	d.Must("exec", "rev", "--", "cat", "/workspace/in.txt")
	d.Must("exec", "rev", "--", "cat", "/proc/sys/kernel/random/uuid") // cannot repeat

	show := d.Must("audit", "show", session, "--dir", dir)
	for _, want := range []string{"vm.lifecycle", "echo hello from carrel", "/workspace/in.txt", "policy.decision"} {
		if !strings.Contains(show, want) {
			t.Errorf("audit show has no %q:\n%s", want, show)
		}
	}

	cast := filepath.Join(t.TempDir(), "s.cast")
	d.Must("audit", "replay", session, "--dir", dir, "--cast", cast)
	f, err := os.Open(cast)
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	var text strings.Builder
	for n := 0; sc.Scan(); n++ {
		if n == 0 {
			var hdr struct{ Version int }
			if err := json.Unmarshal(sc.Bytes(), &hdr); err != nil || hdr.Version != 2 {
				t.Fatalf("cast header %s: %v", sc.Text(), err)
			}
			continue
		}
		var ev [3]any
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			t.Fatalf("cast event %s: %v", sc.Text(), err)
		}
		text.WriteString(ev[2].(string))
	}
	f.Close()
	for _, want := range []string{"hello from carrel", "to stderr", "recorded input"} {
		if !strings.Contains(text.String(), want) {
			t.Errorf("the cast has no %q", want)
		}
	}

	r := d.Carrel("audit", "rerun", session, "--dir", dir, "--vm", "rerun")
	if r.Code != 1 || strings.Count(r.Stdout, "same ") != 3 || !strings.Contains(r.Stdout, "DIFFERS #") || !strings.Contains(r.Stdout, "uuid") {
		t.Errorf("rerun: want 3 steps the same and the uuid different, exit 1: %+v", r)
	}
	if out := d.Must("vm", "ls"); strings.Contains(out, "rerun") {
		t.Errorf("the rerun vm was left behind:\n%s", out)
	}

	d.Stop() // a last signed checkpoint covers the whole session
	bundle := filepath.Join(t.TempDir(), "bundle.tar")
	d.Must("audit", "export", session, "--dir", dir, "--key", key, "-o", bundle)
	report := filepath.Join(t.TempDir(), "report.html")
	d.Must("audit", "report", session, "--dir", dir, "-o", report)
	page, err := os.ReadFile(report)
	if err != nil || !strings.Contains(string(page), "hello from carrel") || !strings.Contains(string(page), "asciinema") {
		t.Errorf("report: %v, %d bytes", err, len(page))
	}

	// Offline, from a copy, with the log itself gone.
	away := filepath.Join(t.TempDir(), "elsewhere.tar")
	if err := exec.Command("cp", bundle, away).Run(); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if out := d.Must("audit", "verify", "--bundle", away, "--key", key); !strings.Contains(out, "ok") {
		t.Errorf("verify --bundle:\n%s", out)
	}
	b, err := os.ReadFile(away)
	if err != nil {
		t.Fatal(err)
	}
	i := strings.Index(string(b), "hello from carrel")
	if i < 0 {
		i = strings.Index(string(b), `"exec.exit"`)
	}
	b[i] ^= 0x20
	if err := os.WriteFile(away, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if r := d.Carrel("audit", "verify", "--bundle", away, "--key", key); r.Code == 0 {
		t.Errorf("verify of a tampered bundle passed: %+v", r)
	}
}
