//go:build linux

package exec

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"connectrpc.com/connect"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/reaper"
	"github.com/carrel-os/carrel/guest-agent/user"
)

// fakeUsers writes a passwd and group file with the image's agent user.
func fakeUsers(t *testing.T) user.Files {
	dir := t.TempDir()
	f := user.Files{Passwd: filepath.Join(dir, "passwd"), Group: filepath.Join(dir, "group")}
	if err := os.WriteFile(f.Passwd, []byte("root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1000:agent:/home/agent:/bin/sh\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(f.Group, []byte("root:x:0:\nagent:x:1000:\nextra:x:1234:root,agent\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return f
}

func requireRoot(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("running commands as other users needs root")
	}
}

func TestUsers(t *testing.T) {
	requireRoot(t)
	r := &Runner{Reaper: reaper.Default(), Dir: "/", Users: fakeUsers(t)}
	script := `echo "$(id -u) $(id -g) $(id -G) $HOME $USER $LOGNAME"`
	tests := []struct {
		user string
		want string
	}{
		{"", "1000 1000 1000 1234 /home/agent agent agent"}, // the default
		{"agent", "1000 1000 1000 1234 /home/agent agent agent"},
		{"1000", "1000 1000 1000 1234 /home/agent agent agent"},
		{"root", "0 0 0 1234 /root root root"},
		{"4321", "4321 4321 4321 /"}, // a uid with no passwd entry
	}
	for _, tt := range tests {
		req := sh(script)
		req.User = tt.user
		res, err := run(t, r, req)
		if err != nil {
			t.Fatalf("user %q: %v", tt.user, err)
		}
		if got := strings.TrimSpace(res.stdout.String()); got != tt.want {
			t.Errorf("user %q: got %q, want %q", tt.user, got, tt.want)
		}
	}

	// The host's own passwd: nobody is uid 65534.
	host := &Runner{Reaper: reaper.Default(), Dir: "/"}
	req := &agentv1.ExecRequest{Argv: []string{"id", "-u"}, User: "nobody"}
	if res, err := run(t, host, req); err != nil || res.stdout.String() != "65534\n" {
		t.Fatalf("nobody: %q %v", res.stdout.String(), err)
	}

	for _, u := range []string{"carrel-nobody", "a:b", strings.Repeat("x", 300), "4294967295"} {
		req := &agentv1.ExecRequest{Argv: []string{"true"}, User: u}
		if _, err := run(t, r, req); connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("user %.20q: %v, want invalid_argument", u, err)
		}
	}
}

// TestUserTTY: the terminal of a command run as another user is its own.
func TestUserTTY(t *testing.T) {
	requireRoot(t)
	r := &Runner{Reaper: reaper.Default(), Dir: "/", Users: fakeUsers(t)}
	req := &agentv1.ExecRequest{Argv: []string{"sh", "-c", `stat -c %u "$(tty)"`}, Tty: true}
	res, err := run(t, r, req)
	if err != nil {
		t.Fatal(err)
	}
	if res.stdout.String() != "1000\r\n" {
		t.Fatalf("terminal owner %q", res.stdout.String())
	}
}

// TestNotRoot: an agent that is not root runs everything as itself.
func TestNotRoot(t *testing.T) {
	old := geteuid
	t.Cleanup(func() { geteuid = old })
	geteuid = func() int { return 1000 }
	r := &Runner{Reaper: reaper.Default(), Users: fakeUsers(t)}
	for _, spec := range []string{"", "agent", "1000"} {
		u, cred, err := r.resolveUser(spec)
		if err != nil || cred != nil || u.UID != 1000 || u.Home != "/home/agent" {
			t.Errorf("%q: %+v %v %v", spec, u, cred, err)
		}
	}
	for _, spec := range []string{"root", "0", "65534"} {
		if _, _, err := r.resolveUser(spec); connect.CodeOf(err) != connect.CodePermissionDenied {
			t.Errorf("%q: %v, want permission_denied", spec, err)
		}
	}
	if _, _, err := r.resolveUser("carrel-nobody"); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("unknown: %v", err)
	}
	// With no passwd entry for the agent's uid, the default still works.
	geteuid = func() int { return 4242 }
	if u, cred, err := r.resolveUser(""); err != nil || cred != nil || u.UID != 4242 {
		t.Errorf("nameless: %+v %v %v", u, cred, err)
	}
}

func TestTTY(t *testing.T) {
	req := &agentv1.ExecRequest{Argv: []string{"sh", "-c", `tty; stty size; echo "$TERM"; echo err >&2`}, Tty: true, Rows: 30, Cols: 100}
	res, err := run(t, runner(t), req)
	if err != nil {
		t.Fatal(err)
	}
	out := res.stdout.String()
	if !strings.HasPrefix(out, "/dev/pts/") || !strings.Contains(out, "\r\n30 100\r\nxterm-256color\r\nerr\r\n") || res.stderr.Len() != 0 {
		t.Fatalf("stdout %q stderr %q", out, res.stderr.String())
	}
	if res.exit(t).Code != 0 {
		t.Fatalf("exit %v", res.exit(t))
	}
	req.Env = []string{"TERM=vt100"}
	if res, err = run(t, runner(t), req); err != nil || !strings.Contains(res.stdout.String(), "vt100\r\n") {
		t.Fatalf("TERM from the request: %q %v", res.stdout.String(), err)
	}
}

func TestExecRefusesDetach(t *testing.T) {
	res, err := run(t, runner(t), &agentv1.ExecRequest{Argv: []string{"true"}, Detach: true})
	if connect.CodeOf(err) != connect.CodeInvalidArgument || len(res.events) != 0 {
		t.Fatalf("err %v, %d events", err, len(res.events))
	}
}

func TestUserCannotEnterDir(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir() // 0700, root's
	r := &Runner{Reaper: reaper.Default(), Dir: "/", Users: fakeUsers(t)}
	_, err := run(t, r, &agentv1.ExecRequest{Argv: []string{"true"}, Cwd: dir})
	if connect.CodeOf(err) != connect.CodePermissionDenied || !strings.Contains(err.Error(), "working directory") {
		t.Fatalf("err %v, want permission_denied naming the directory", err)
	}
}
