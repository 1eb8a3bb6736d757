package tests

import (
	"context"
	"encoding/binary"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/tests/harness"
)

// TestAuditRecoverAfterDamage: one byte flipped in the middle of the
// audit log keeps carreld from starting, with an error that names the
// recovery step; after carrel audit recover, carreld starts, new records
// verify, and verify names the sealed log's unreadable record exactly.
func TestAuditRecoverAfterDamage(t *testing.T) {
	harness.RequireVM(t)
	d := harness.New(t)
	d.Start()
	for range 20 { // records: each call's decision and api.call
		d.Must("vm", "ls")
	}
	d.Stop()
	auditDir := filepath.Join(d.State, "audit")
	path := filepath.Join(auditDir, "records.log")
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var offs []int
	for off := 0; off+8 <= len(b); off += 8 + int(binary.LittleEndian.Uint32(b[off:])) {
		offs = append(offs, off)
	}
	if len(offs) < 30 {
		t.Fatalf("only %d records", len(offs))
	}
	victim := len(offs) / 2
	b[offs[victim]+8+20] ^= 0x04
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, filepath.Join(d.Bin, "carreld"), "--state-dir", d.State, "--socket", d.Socket,
		"--cache-dir", harness.CacheDir(), "--agent", filepath.Join(d.Bin, "carrel-agent")).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "audit log corrupt") || !strings.Contains(string(out), "carrel audit recover --dir "+auditDir) {
		t.Fatalf("carreld on a damaged log: %v\n%s", err, out)
	}

	r := d.Carrel("audit", "recover", "--dir", auditDir)
	if r.Code != 0 || !strings.Contains(r.Stdout, "unreadable: "+strconv.Itoa(victim)) {
		t.Fatalf("carrel audit recover: %+v", r)
	}
	d.Start()
	d.Must("vm", "ls")
	d.Stop()
	v := d.Carrel("audit", "verify", "--dir", auditDir)
	if v.Code != 0 || !strings.Contains(v.Stdout, "sealed log sealed/") || !strings.Contains(v.Stdout, "unreadable: "+strconv.Itoa(victim)) {
		t.Errorf("verify after the recovery: %+v", v)
	}
	// The sealed log reads as a log of its own.
	sealed, _ := filepath.Glob(filepath.Join(auditDir, "sealed", "*"))
	if len(sealed) != 1 {
		t.Fatalf("sealed logs: %v", sealed)
	}
	if s := d.Carrel("audit", "verify", "--dir", sealed[0]); s.Code == 0 || !strings.Contains(s.Stdout, "record "+strconv.Itoa(victim)) {
		t.Errorf("verify of the sealed log itself: %+v", s)
	}
}
