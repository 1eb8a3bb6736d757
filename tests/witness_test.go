package tests

import (
	"crypto/rand"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/mod/sumdb/note"

	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/audit/audittest"
	"github.com/carrel-os/carrel/tests/harness"
)

// TestWitnessedAuditLog: carreld shows its audit log's checkpoints to a
// witness (carrel witness serve, a separate process), which cosigns them;
// carrel audit verify --witness then passes. A host that rewrites a record
// and signs every later checkpoint again with its own key passes a plain
// verify, and fails the witnessed one, which names the checkpoint.
func TestWitnessedAuditLog(t *testing.T) {
	harness.RequireVM(t)
	bin := harness.Bins(t)
	work := t.TempDir()

	// The log's key is made here, so that the witness knows it before
	// carreld's first start.
	skey, vkey, err := note.GenerateKey(rand.Reader, audit.KeyName)
	if err != nil {
		t.Fatal(err)
	}
	wkeyFile := filepath.Join(work, "witness.key")
	out, err := exec.Command(filepath.Join(bin, "carrel"), "witness", "keygen", "w1.test", wkeyFile).Output()
	if err != nil {
		t.Fatalf("carrel witness keygen: %v", err)
	}
	wkey := strings.TrimSpace(string(out))
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	w := exec.Command(filepath.Join(bin, "carrel"), "witness", "serve", "--key", wkeyFile, "--log", vkey,
		"--state", filepath.Join(work, "witness-state"), "--listen", addr)
	w.Stderr = os.Stderr
	if err := w.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Process.Kill(); w.Wait() })

	d := harness.New(t, "--witness", "http://"+addr+","+wkey)
	auditDir := filepath.Join(d.State, "audit")
	if err := os.MkdirAll(auditDir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(auditDir, "key"), []byte(skey+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	d.Start()
	d.BuildImage()
	d.Must("vm", "create", "wit", "--memory", "256M")
	d.Must("exec", "wit", "--", "echo", "witnessed")
	d.Must("vm", "rm", "--force", "wit")

	verify := func(args ...string) harness.Result {
		return d.Carrel(append([]string{"audit", "verify", "--dir", auditDir, "--key", vkey}, args...)...)
	}
	cosigned := func() {
		t.Helper()
		deadline := time.Now().Add(time.Minute)
		for {
			r := verify("--witness", wkey)
			if r.Code == 0 {
				if !strings.Contains(r.Stdout, "witnessed up to") {
					t.Errorf("verify --witness: %s", r.Stdout)
				}
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("the log's checkpoints were not cosigned within a minute: %+v", r)
			}
			time.Sleep(time.Second)
		}
	}
	cosigned()
	if !strings.Contains(d.Logs(), "audit checkpoint") {
		t.Error("no checkpoint in carreld's log (the journal's copy)")
	}
	// A stop signs a last checkpoint that no witness has seen yet: verify
	// says so. The next start shows it to the witness.
	d.Stop()
	if r := verify("--witness", wkey); r.Code == 0 || !strings.Contains(r.Stdout, "lacks 1 valid cosignatures") {
		t.Errorf("after the stop, the last checkpoint is not witnessed yet: %+v", r)
	}
	d.Start()
	cosigned()
	d.Stop()

	// The rewrite, by someone holding the host's key.
	if err := audittest.RewriteRecord(auditDir, 3); err != nil {
		t.Fatal(err)
	}
	if r := verify(); r.Code != 0 {
		t.Errorf("a plain verify of the rewritten log should pass (the host's key vouches for it): %+v", r)
	}
	r := verify("--witness", wkey)
	if r.Code == 0 || !strings.Contains(r.Stdout, "cosignature at checkpoint") || !strings.Contains(r.Stdout, "the cosignature of witness w1.test does not match") {
		t.Errorf("verify --witness of the rewritten log: %+v", r)
	}
}
