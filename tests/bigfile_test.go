package tests

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/tests/harness"
)

// TestGiBFile moves a 1 GiB file into a VM and back with carrel cp. The
// file is larger than carreld's and the agent's memory use is allowed to
// grow: both stream it, so their peak resident sets stay small.
func TestGiBFile(t *testing.T) {
	const size = 1 << 30
	d := harness.New(t)
	d.Start()
	d.BuildImage()
	// /workspace is half the guest's memory by default: 1.25 GiB holds
	// the file as it is written beside its name and renamed over it.
	d.Must("vm", "create", "big", "--memory", "2560M")
	dir := t.TempDir()
	local := filepath.Join(dir, "gib")
	want := writeRandom(t, local, size)

	start := time.Now()
	d.Must("cp", local, "big:/workspace/gib")
	up := time.Since(start)
	if out := d.Must("exec", "big", "--", "sha256sum", "/workspace/gib"); !strings.HasPrefix(out, want) {
		t.Fatalf("guest sha256 %q, want %s", out, want)
	}
	back := filepath.Join(dir, "back")
	start = time.Now()
	d.Must("cp", "big:/workspace/gib", back)
	down := time.Since(start)
	if got := fileSHA256(t, back); got != want {
		t.Fatalf("copied back sha256 %s, want %s", got, want)
	}
	t.Logf("1 GiB: up %v (%.0f MiB/s), down %v (%.0f MiB/s)", up.Round(time.Millisecond), 1024/up.Seconds(), down.Round(time.Millisecond), 1024/down.Seconds())

	// Peak resident sets: the agent's (PID 1 in the guest) and carreld's.
	agent := d.Must("exec", "big", "--", "grep", "VmHWM", "/proc/1/status")
	var agentKB int64
	if _, err := fmt.Sscanf(strings.TrimSpace(agent), "VmHWM: %d kB", &agentKB); err != nil {
		t.Fatalf("agent VmHWM: %q: %v", agent, err)
	}
	hostKB := procStatusKB(t, d.Pid(), "VmHWM")
	t.Logf("peak RSS: carrel-agent %d MiB, carreld %d MiB", agentKB>>10, hostKB>>10)
	if agentKB > 256<<10 || hostKB > 256<<10 {
		t.Errorf("peak RSS carrel-agent %d MiB, carreld %d MiB: a 1 GiB file was held in memory", agentKB>>10, hostKB>>10)
	}
}

// writeRandom writes size pseudo-random bytes to path and returns their
// sha256.
func writeRandom(t *testing.T, path string, size int64) string {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	w := bufio.NewWriterSize(io.MultiWriter(f, h), 1<<20)
	if _, err := io.CopyN(w, rand.NewChaCha8([32]byte{'g', 'i', 'b'}), size); err != nil {
		t.Fatal(err)
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

func fileSHA256(t *testing.T, path string) string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}
