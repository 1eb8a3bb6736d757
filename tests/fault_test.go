package tests

import (
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/carrel-os/carrel/tests/harness"
)

// TestFrozenGuestIsUnhealthyAndOthersKeepWorking freezes one VM's QEMU (as a
// wedged or hostile guest would look from the host): carreld must mark its
// agent unhealthy, log that once, and keep serving the other VM. Thawed, the
// agent is marked ready again.
func TestFrozenGuestIsUnhealthyAndOthersKeepWorking(t *testing.T) {
	d := harness.New(t)
	d.Start()
	d.BuildImage()
	d.Must("vm", "create", "frozen", "--memory", "256M")
	d.Must("vm", "create", "fine", "--memory", "256M")
	v, _ := vmNamed(t, d, "frozen")
	if err := syscall.Kill(v.Pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	defer syscall.Kill(v.Pid, syscall.SIGCONT)

	// An exec into the frozen VM fails at its deadline; it does not hang.
	start := time.Now()
	r := d.Carrel("exec", "frozen", "--timeout", "3s", "--", "true")
	if r.Code == 0 || time.Since(start) > 30*time.Second {
		t.Errorf("exec into a frozen vm: %+v after %s", r, time.Since(start))
	}
	// The other VM is served all along.
	if out := d.Must("exec", "fine", "--", "echo", "ok"); out != "ok\n" {
		t.Errorf("exec into the healthy vm: %q", out)
	}
	waitAgent(t, d, "frozen", "AGENT_STATE_UNHEALTHY", 40*time.Second)
	if n := strings.Count(d.Logs(), `msg="guest agent unhealthy`); n != 1 {
		t.Errorf("unhealthy logged %d times, want once", n)
	}
	if out := d.Must("exec", "fine", "--", "echo", "still ok"); out != "still ok\n" {
		t.Errorf("exec into the healthy vm: %q", out)
	}

	syscall.Kill(v.Pid, syscall.SIGCONT)
	waitAgent(t, d, "frozen", "AGENT_STATE_READY", 40*time.Second)
	if out := d.Must("exec", "frozen", "--", "echo", "thawed"); out != "thawed\n" {
		t.Errorf("exec after thaw: %q", out)
	}
	d.Must("vm", "rm", "--force", "frozen")
	d.Must("vm", "rm", "--force", "fine")
}

func waitAgent(t *testing.T, d *harness.Daemon, name, want string, limit time.Duration) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for {
		v, _ := vmNamed(t, d, name)
		if v.AgentState == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent of %s is %s after %s, want %s", name, v.AgentState, limit, want)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
