package tests

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/tests/harness"
)

// TestPolicyInTheVM shows policy at both walls of a real VM: the host
// denies calls before they reach the guest, and inside the guest a
// command cannot write where the policy does not let it, even though it
// goes around the API and the path is open to it by Unix permissions.
func TestPolicyInTheVM(t *testing.T) {
	d := harness.New(t)
	d.Start()
	d.BuildImage()
	d.Must("vm", "create", "locked", "--policy", "locked-down", "--memory", "256M")
	if out := d.Must("vm", "ls"); !strings.Contains(out, "locked-down") {
		t.Errorf("vm ls does not show the policy:\n%s", out)
	}

	// In the guest: /tmp is world-writable, but locked-down's only
	// read-write root is /workspace, and Landlock holds the command to it.
	if out := d.Must("exec", "locked", "--", "stat", "-c", "%a", "/tmp"); out != "1777\n" {
		t.Fatalf("/tmp mode %q: the test needs a path the agent user may write by permissions", out)
	}
	r := d.Carrel("exec", "locked", "--", "sh", "-c", "echo x > /tmp/escape")
	if r.Code == 0 || !strings.Contains(r.Stderr, "ermission denied") {
		t.Errorf("write to /tmp under locked-down: %+v", r)
	}
	if out := d.Must("exec", "locked", "--", "sh", "-c", "echo ok > /workspace/in && cat /workspace/in"); out != "ok\n" {
		t.Errorf("write to /workspace: %q", out)
	}
	// Landlock does not govern stat, so this sees /tmp as it is.
	if out := d.Must("exec", "locked", "--", "sh", "-c", "test -e /tmp/escape && echo present || echo absent"); out != "absent\n" {
		t.Errorf("/tmp/escape: %q", out)
	}
	// no_new_privs is on for every command.
	if out := d.Must("exec", "locked", "--", "grep", "NoNewPrivs", "/proc/self/status"); !strings.Contains(out, "1") {
		t.Errorf("NoNewPrivs: %q", out)
	}

	// On the host: decided before the guest sees them, naming the rule.
	local := filepath.Join(t.TempDir(), "f")
	os.WriteFile(local, []byte("x"), 0o644)
	for _, c := range []struct {
		args []string
		rule string
	}{
		{[]string{"cp", local, "locked:/tmp/f"}, "carrel.fs.default_deny"},
		{[]string{"cp", "locked:/etc/shadow", "-"}, "carrel.fs.secret_path"},
		{[]string{"cp", local, "locked:/workspace/.ssh/authorized_keys"}, "carrel.fs.secret_path"},
		{[]string{"cp", local, "locked:/workspace/../tmp/f"}, "carrel.fs"},
		{[]string{"exec", "locked", "--", "wget", "http://example.com"}, "carrel.exec.denied_command"},
		{[]string{"exec", "--user", "root", "locked", "--", "id"}, "carrel.exec.root_user"},
	} {
		r := d.Carrel(c.args...)
		if r.Code == 0 || !strings.Contains(r.Stderr, "denied by policy locked-down") || !strings.Contains(r.Stderr, c.rule) {
			t.Errorf("carrel %s: exit %d, stderr %q; want a deny naming %s", strings.Join(c.args, " "), r.Code, r.Stderr, c.rule)
		}
	}
	if out := d.Must("policy", "decisions", "--vm", "locked", "--denied"); !strings.Contains(out, "carrel.exec.denied_command") || !strings.Contains(out, "carrel.fs.secret_path") {
		t.Errorf("recorded denies:\n%s", out)
	}

	// Replace the VM's policy while it runs: the host and the guest both
	// follow at once.
	d.ApplyPolicy("tmp-ok", func(s map[string]any) {})
	d.Must("policy", "apply", "tmp-ok", "--vm", "locked")
	if out := d.Must("exec", "locked", "--", "sh", "-c", "echo y > /tmp/now && cat /tmp/now"); out != "y\n" {
		t.Errorf("write to /tmp after the policy change: %q", out)
	}
	d.Must("cp", local, "locked:/tmp/f")
	// A bundle that does not compile is refused; the old one keeps serving.
	bad := t.TempDir()
	os.WriteFile(filepath.Join(bad, "fs.rego"), []byte("package carrel.fs\n\ndecision := {"), 0o644)
	if r := d.Carrel("policy", "apply", "tmp-ok", bad); r.Code == 0 || !strings.Contains(r.Stderr, "invalid policy bundle") {
		t.Errorf("broken bundle applied: %+v", r)
	}
	d.Must("cp", local, "locked:/tmp/g")

	// A token scoped to this VM: its harness may work in it, and nothing
	// else.
	token := strings.TrimSpace(d.Must("token", "create", "locked"))
	if out := d.Must("--token", token, "exec", "locked", "--", "echo", "as token"); out != "as token\n" {
		t.Errorf("exec with a token: %q", out)
	}
	for _, args := range [][]string{{"vm", "ls"}, {"vm", "rm", "--force", "locked"}, {"token", "create", "locked"}} {
		if r := d.Carrel(append([]string{"--token", token}, args...)...); r.Code == 0 || !strings.Contains(r.Stderr, "carrel.api.token") {
			t.Errorf("carrel --token %s: %+v", strings.Join(args, " "), r)
		}
	}
	if r := d.Carrel("--token", "carrel_0000000000000000_00000000000000000000000000000000", "vm", "ls"); r.Code == 0 || !strings.Contains(r.Stderr, "unknown or revoked token") {
		t.Errorf("a made-up token: %+v", r)
	}
}
