//go:build linux

package server

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"connectrpc.com/connect"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/sandbox"
)

// serveSandboxed serves with one Guard behind SetSandbox, the commands
// and the file service, as carrel-agent does.
func serveSandboxed(t *testing.T) *fixture {
	return serve(t, func(c *Config) {
		c.Sandbox = &sandbox.Guard{}
		c.Runner.Sandbox = c.Sandbox
	})
}

func TestSetSandboxRefusesBadRequests(t *testing.T) {
	f := serveSandboxed(t)
	outside := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(outside, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, req := range []*agentv1.SetSandboxRequest{
		{ReadWrite: []string{"workspace"}},
		{ReadOnly: []string{"/usr/"}},
		{Denied: []string{"/etc/../etc/shadow"}},
		{ReadWrite: []string{"/tmp\x00"}},
		{ReadOnly: make([]string, sandbox.MaxPaths+1)},
		{ReadWrite: []string{"/" + strings.Repeat("x", sandbox.MaxPathBytes)}},
	} {
		_, err := f.client.SetSandbox(callCtx(t), connect.NewRequest(req))
		if connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("SetSandbox(%.80v): %v, want CodeInvalidArgument", req, err)
		}
	}
	// No sandbox was set: the file service still reaches everything.
	if _, err := f.files.Stat(callCtx(t), connect.NewRequest(&agentv1.StatRequest{Path: outside})); err != nil {
		t.Fatalf("after refused requests: %v", err)
	}
}

func TestSetSandboxConfinesCommandsAndFiles(t *testing.T) {
	f := serveSandboxed(t)
	outside := t.TempDir()
	resp, err := f.client.SetSandbox(callCtx(t), connect.NewRequest(&agentv1.SetSandboxRequest{
		ReadWrite: []string{f.dir},
		ReadOnly:  []string{"/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc"},
		Denied:    []string{"/etc/shadow"},
		Revision:  "test-1",
	}))
	if err != nil {
		t.Fatal(err)
	}
	abi, abiErr := sandbox.ABI()
	if resp.Msg.Landlock != (abiErr == nil) || int(resp.Msg.LandlockAbi) != abi || resp.Msg.Detail == "" {
		t.Fatalf("response %v; kernel ABI %d (%v)", resp.Msg, abi, abiErr)
	}

	// The file service keeps to the roots.
	_, err = f.files.Stat(callCtx(t), connect.NewRequest(&agentv1.StatRequest{Path: outside}))
	if connect.CodeOf(err) != connect.CodePermissionDenied || !strings.Contains(err.Error(), "guest sandbox") {
		t.Fatalf("stat outside the roots: %v", err)
	}
	_, err = f.files.Stat(callCtx(t), connect.NewRequest(&agentv1.StatRequest{Path: "/etc/shadow"}))
	if connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Fatalf("stat of a secret path: %v", err)
	}
	if _, err := f.files.Stat(callCtx(t), connect.NewRequest(&agentv1.StatRequest{Path: "/etc/passwd"})); err != nil {
		t.Fatalf("stat under a read-only root: %v", err)
	}

	// Commands run with no_new_privs, and under Landlock cannot write
	// outside the roots.
	res, err := execute(callCtx(t), f.client, &agentv1.ExecRequest{Argv: []string{"sh", "-c",
		"grep NoNewPrivs /proc/self/status; echo x > " + outside + "/f"}})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(res.stdout.String(), "NoNewPrivs:\t1") {
		t.Errorf("stdout %q, want NoNewPrivs 1", res.stdout.String())
	}
	if abiErr != nil {
		t.Skipf("no Landlock on this kernel (landlock ABI is 0): %v", abiErr)
	}
	if res.exit.Code == 0 || !strings.Contains(res.stderr.String(), "Permission denied") {
		t.Errorf("writing outside the roots: exit %v, stderr %q; want a permission error", res.exit, res.stderr.String())
	}
	// A terminal session works under the sandbox.
	res, err = execute(callCtx(t), f.client, &agentv1.ExecRequest{Argv: []string{"sh", "-c", "echo ok > /dev/tty; echo x > f && cat f"}, Tty: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.exit.Code != 0 || !strings.Contains(res.stdout.String(), "ok") || !strings.Contains(res.stdout.String(), "x") {
		t.Errorf("on a terminal: exit %v, output %q", res.exit, res.stdout.String())
	}
}
