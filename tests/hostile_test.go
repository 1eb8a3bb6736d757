package tests

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/tests/harness"
)

// misbehavingAgent builds the test build of carrel-agent, which misbehaves
// on its link to the host when told to (see cmd/carrel-agent/misbehave.go).
func misbehavingAgent(t *testing.T) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "carrel-agent")
	cmd := exec.Command("go", "build", "-tags", "carrel_misbehave", "-o", out, "./cmd/carrel-agent")
	cmd.Dir = harness.RepoRoot()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build the misbehaving agent: %v\n%s", err, b)
	}
	return out
}

// TestHostileGuestLink turns one VM's agent hostile in each way the link
// can be abused. Each time the host must close that link, mark the agent
// unhealthy and log it once, keep serving the other VM, and take the
// hostile VM's agent back once it behaves.
func TestHostileGuestLink(t *testing.T) {
	d := harness.New(t, "--agent", misbehavingAgent(t))
	d.Start()
	d.BuildImage()
	d.Must("vm", "create", "bad", "--memory", "256M")
	d.Must("vm", "create", "good", "--memory", "256M")

	for _, mode := range []string{"garbage", "oversized", "slowloris", "silent"} {
		t.Run(mode, func(t *testing.T) {
			before := strings.Count(d.Logs(), "guest agent unhealthy")
			asked := time.Now()
			d.Must("exec", "bad", "--", "sh", "-c", "echo "+mode+" > /tmp/misbehave")
			// The host logs the agent unhealthy once per incident. The
			// state itself may last less than a poll: a link closed on
			// garbage is dialled again, and healthy, within 200 ms.
			deadline := time.Now().Add(60 * time.Second)
			for strings.Count(d.Logs(), "guest agent unhealthy") == before {
				if time.Now().After(deadline) {
					t.Fatalf("%s: the host did not mark the agent unhealthy within a minute", mode)
				}
				time.Sleep(20 * time.Millisecond)
			}
			// The agent misbehaves about a second after it is asked; the
			// host must notice within 10 s of that (keepalive interval
			// plus the probe's timeout), with room for a slow TCG host.
			noticed := time.Since(asked)
			t.Logf("%s: the host marked the agent unhealthy %s after it was asked to misbehave", mode, noticed.Round(100*time.Millisecond))
			if noticed > 12*time.Second {
				t.Errorf("%s noticed after %s, want within 10 s of the misbehaviour", mode, noticed.Round(100*time.Millisecond))
			}
			// carreld answers, and the other VM works, while this one is bad.
			start := time.Now()
			if out := d.Must("exec", "good", "--", "echo", "fine"); out != "fine\n" {
				t.Errorf("good vm: %q", out)
			}
			if took := time.Since(start); took > 10*time.Second {
				t.Errorf("exec in the good vm took %s", took)
			}
			if n := strings.Count(d.Logs(), "guest agent unhealthy") - before; n != 1 {
				t.Errorf("unhealthy logged %d times for %s, want once", n, mode)
			}
			waitAgent(t, d, "bad", "AGENT_STATE_READY", 90*time.Second)
			if out := d.Must("exec", "bad", "--", "echo", "recovered"); out != "recovered\n" {
				t.Errorf("bad vm after %s: %q", mode, out)
			}
		})
	}

	t.Run("output flood", func(t *testing.T) {
		// A command that writes as fast as it can: flow control bounds
		// what the host holds, and the exec's deadline ends it.
		r := d.CarrelTimeout(60*time.Second, "exec", "--timeout", "5s", "bad", "--", "yes", "flood")
		if r.Code == 0 || len(r.Stdout) == 0 {
			t.Errorf("flood: exit %d after %d bytes", r.Code, len(r.Stdout))
		}
		if out := d.Must("exec", "good", "--", "echo", "fine"); out != "fine\n" {
			t.Errorf("good vm after the flood: %q", out)
		}
		rss := carreldRSS(t, d)
		t.Logf("carreld RSS after the flood: %d MiB", rss>>20)
		if rss > 512<<20 {
			t.Errorf("carreld RSS %d MiB after an output flood", rss>>20)
		}
	})
	d.Must("vm", "rm", "--force", "bad")
	d.Must("vm", "rm", "--force", "good")
}

// carreldRSS reads the daemon's resident set size from /proc.
func carreldRSS(t *testing.T, d *harness.Daemon) int64 {
	t.Helper()
	return procStatusKB(t, d.Pid(), "VmRSS") << 10
}

// procStatusKB reads one "Field: N kB" line of a host process's
// /proc/PID/status.
func procStatusKB(t *testing.T, pid int, field string) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		var kb int64
		if _, err := fmt.Sscanf(line, field+": %d kB", &kb); err == nil {
			return kb
		}
	}
	t.Fatalf("no %s in /proc/%d/status", field, pid)
	return 0
}
