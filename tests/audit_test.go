package tests

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/tests/harness"
)

// TestAuditRecordsDecisions checks that a real session's policy decisions
// are in carreld's audit log, that the log verifies offline against the
// key kept apart from it, and that a flipped byte in a copy is found.
func TestAuditRecordsDecisions(t *testing.T) {
	d := harness.New(t)
	d.Start()
	d.BuildImage()
	dir := filepath.Join(d.State, "audit")
	key := strings.TrimSpace(d.Must("audit", "key", "--dir", dir))
	if !strings.HasPrefix(key, "carrel-audit+") {
		t.Fatalf("audit key %q", key)
	}
	d.Must("vm", "create", "rec", "--memory", "256M")
	d.Must("exec", "rec", "--", "true")
	d.Carrel("cp", "rec:/etc/shadow", "-") // a deny, on record too
	d.Stop()                               // closing signs a last checkpoint

	out := d.Must("audit", "verify", "--dir", dir, "--key", key)
	if !strings.Contains(out, "ok: the log is intact") {
		t.Fatalf("verify:\n%s", out)
	}
	log, err := os.ReadFile(filepath.Join(dir, "records.log"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"policy.decision"`, `carrel.api.operator`, `carrel.exec.user`, `carrel.fs.secret_path`, `"action":"exec"`, `"exec.exit"`} {
		if !bytes.Contains(log, []byte(want)) {
			t.Errorf("records.log has no %s", want)
		}
	}

	// A copy with one byte of a decision changed.
	tampered := filepath.Join(t.TempDir(), "audit")
	if err := exec.Command("cp", "-a", dir, tampered).Run(); err != nil {
		t.Fatal(err)
	}
	i := bytes.Index(log, []byte("carrel.exec.user"))
	log[i] = 'C'
	if err := os.WriteFile(filepath.Join(tampered, "records.log"), log, 0o600); err != nil {
		t.Fatal(err)
	}
	r := d.Carrel("audit", "verify", "--dir", tampered, "--key", key)
	if r.Code != 1 || !strings.Contains(r.Stdout, "record ") || !strings.Contains(r.Stderr, "FAILED verification") {
		t.Errorf("verify of a tampered copy: %+v", r)
	}
}
