//go:build linux

package exec

import (
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"connectrpc.com/connect"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/sandbox"
)

func TestCommandsHaveNoNewPrivs(t *testing.T) {
	res, err := run(t, runner(t), sh("grep NoNewPrivs /proc/self/status"))
	if err != nil {
		t.Fatal(err)
	}
	if res.exit(t).Code != 0 || !strings.Contains(res.stdout.String(), "NoNewPrivs:\t1") {
		t.Fatalf("exit %v, %q; want NoNewPrivs 1", res.exit(t), res.stdout.String())
	}
}

// landlockedRunner returns a runner confined to its working directory
// (read-write) and the system's directories (read-only), and a directory
// outside both. It skips the test without Landlock.
func landlockedRunner(t *testing.T) (*Runner, string) {
	t.Helper()
	if _, err := sandbox.ABI(); err != nil {
		t.Skipf("needs Landlock (landlock ABI is 0): %v", err)
	}
	r := runner(t)
	r.Sandbox = &sandbox.Guard{}
	st, err := r.Sandbox.Set(sandbox.Policy{
		ReadWrite: []string{r.Dir},
		ReadOnly:  []string{"/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc"},
	})
	if err != nil {
		t.Fatal(err)
	}
	if !st.Landlock {
		t.Fatalf("no Landlock: %+v", st)
	}
	return r, t.TempDir()
}

func TestCommandCannotWriteOutsideTheRoots(t *testing.T) {
	r, outside := landlockedRunner(t)
	res, err := run(t, r, sh("echo x > "+outside+"/f"))
	if err != nil {
		t.Fatal(err)
	}
	if res.exit(t).Code == 0 || !strings.Contains(res.stderr.String(), "Permission denied") {
		t.Errorf("writing outside the roots: exit %v, stderr %q; want a permission error", res.exit(t), res.stderr.String())
	}
	if _, err := os.Stat(filepath.Join(outside, "f")); !os.IsNotExist(err) {
		t.Errorf("the file outside the roots exists: %v", err)
	}

	// Inside the read-write root, and with the devices and /proc, all is well.
	res, err = run(t, r, sh("echo x > f && mkdir d && mv f d/g && cat d/g && echo y > /dev/null && head -c1 /dev/urandom >/dev/null && ls /proc/self/fd >/dev/null"))
	if err != nil {
		t.Fatal(err)
	}
	if res.exit(t).Code != 0 || res.stdout.String() != "x\n" {
		t.Errorf("inside the root: exit %v, stdout %q, stderr %q", res.exit(t), res.stdout.String(), res.stderr.String())
	}
}

func TestTerminalCommandUnderLandlock(t *testing.T) {
	r, outside := landlockedRunner(t)
	res, err := run(t, r, &agentv1.ExecRequest{Argv: []string{"sh", "-c",
		"tty >/dev/null && echo hi > /dev/tty && stty size && (echo x > " + outside + "/f || echo refused)"}, Tty: true})
	if err != nil {
		t.Fatal(err)
	}
	out := res.stdout.String()
	if res.exit(t).Code != 0 || !strings.Contains(out, "hi") || !strings.Contains(out, "24 80") || !strings.Contains(out, "refused") {
		t.Errorf("on a terminal: exit %v, output %q", res.exit(t), out)
	}
}

func TestProgramOutsideTheRootsDoesNotRun(t *testing.T) {
	r, outside := landlockedRunner(t)
	src, err := os.Open("/bin/true")
	if err != nil {
		t.Skip("no /bin/true")
	}
	defer src.Close()
	prog := filepath.Join(outside, "true")
	dst, err := os.OpenFile(prog, os.O_WRONLY|os.O_CREATE, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(dst, src); err != nil {
		t.Fatal(err)
	}
	dst.Close()
	_, err = run(t, r, &agentv1.ExecRequest{Argv: []string{prog}})
	if connect.CodeOf(err) != connect.CodePermissionDenied || !strings.Contains(err.Error(), "guest sandbox") {
		t.Fatalf("running a program outside the roots: %v, want CodePermissionDenied naming the guest sandbox", err)
	}
}
