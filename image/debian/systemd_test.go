package debian

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/image/devimage"
)

func TestSystemdSpec(t *testing.T) {
	s := validSpec()
	if got := s.installPackages(); !slices.Equal(got, s.Packages) || s.cmdline() != "" {
		t.Errorf("carrel-agent init: packages %v, cmdline %q", got, s.cmdline())
	}
	s.Init = InitSystemd
	s.Packages = append(s.Packages, "udev")
	if err := s.Validate(); err != nil {
		t.Fatal(err)
	}
	got := s.installPackages()
	for _, want := range []string{"bash", "coreutils", "systemd", "systemd-sysv", "udev"} {
		if !slices.Contains(got, want) {
			t.Errorf("packages %v lack %s", got, want)
		}
	}
	if strings.Count(strings.Join(got, " "), "udev") != 1 {
		t.Errorf("udev twice: %v", got)
	}
	if c := s.cmdline(); c != devimage.DefaultCmdline+" init=/lib/systemd/systemd" {
		t.Errorf("cmdline %q", c)
	}
	s.Init = "sysvinit"
	if err := s.Validate(); !errors.Is(err, ErrInvalidSpec) {
		t.Errorf("init sysvinit: %v", err)
	}
}

func TestInstallAgentService(t *testing.T) {
	root := t.TempDir()
	agent := filepath.Join(t.TempDir(), "carrel-agent")
	if err := os.WriteFile(agent, []byte("agent binary"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := installAgentService(root, agent); err == nil || !strings.Contains(err.Error(), "/lib/systemd/systemd") {
		t.Errorf("a root without systemd: %v", err)
	}
	writeTestFile(t, filepath.Join(root, "lib/systemd/systemd"), "systemd", 0o755)
	if err := installAgentService(root, agent); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(filepath.Join(root, AgentPath))
	if b, _ := os.ReadFile(filepath.Join(root, AgentPath)); err != nil || fi.Mode().Perm() != 0o755 || string(b) != "agent binary" {
		t.Errorf("agent %v %v", fi, err)
	}
	unit, err := os.ReadFile(filepath.Join(root, AgentUnitPath))
	if err != nil || !strings.Contains(string(unit), "ExecStart="+AgentPath+" --system\n") || !strings.Contains(string(unit), "Delegate=yes") ||
		!strings.Contains(string(unit), "WantedBy=multi-user.target") {
		t.Errorf("unit %q, %v", unit, err)
	}
	link := filepath.Join(root, "etc/systemd/system/multi-user.target.wants/carrel-agent.service")
	if target, err := os.Readlink(link); err != nil || target != AgentUnitPath {
		t.Errorf("enabled by %q, %v", target, err)
	}
	// Again: the same result, no error.
	if err := installAgentService(root, agent); err != nil {
		t.Errorf("second install: %v", err)
	}
}
