package debian

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"

	"github.com/carrel-os/carrel/image/devimage"
)

// Where an image whose init is systemd keeps carrel-agent and its unit.
const (
	AgentPath     = "/usr/libexec/carrel/carrel-agent"
	AgentUnitPath = "/etc/systemd/system/carrel-agent.service"
	systemdInit   = "/lib/systemd/systemd"
)

// agentUnit runs carrel-agent as the guest's agent (--system) with its
// cgroup delegated, so that each command gets a cgroup of its own below
// it, and restarts it whenever it stops.
const agentUnit = `[Unit]
Description=carrel guest agent: serves the host over vsock or virtio-serial
Documentation=https://github.com/carrel-os/carrel
After=local-fs.target

[Service]
ExecStart=` + AgentPath + ` --system
Restart=always
RestartSec=1
Delegate=yes
# The agent ends its commands; systemd gives the rest a grace period.
KillMode=mixed

[Install]
WantedBy=multi-user.target
`

// installPackages are the packages mmdebstrap installs: the spec's, plus
// systemd and udev (which names the disks) for a systemd image.
func (s *Spec) installPackages() []string {
	pkgs := slices.Clone(s.Packages)
	if s.Init == InitSystemd {
		for _, p := range []string{"systemd", "systemd-sysv", "udev"} {
			if !slices.Contains(pkgs, p) {
				pkgs = append(pkgs, p)
			}
		}
	}
	return pkgs
}

// cmdline is the image's kernel command line: carrel-agent hands over to
// systemd after it switches to the verified root when init= names it.
func (s *Spec) cmdline() string {
	if s.Init == InitSystemd {
		return devimage.DefaultCmdline + " init=" + systemdInit
	}
	return ""
}

// installAgentService puts carrel-agent and its unit in the root, enabled.
func installAgentService(root, agentBinary string) error {
	if _, err := os.Stat(filepath.Join(root, systemdInit[1:])); err != nil {
		return fmt.Errorf("the image has no %s: %w", systemdInit, err)
	}
	dst := filepath.Join(root, AgentPath[1:])
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	if err := copyExecutable(agentBinary, dst); err != nil {
		return err
	}
	if err := writeFile(root, AgentUnitPath, 0o644, agentUnit); err != nil {
		return err
	}
	wants := filepath.Join(root, "etc/systemd/system/multi-user.target.wants")
	if err := os.MkdirAll(wants, 0o755); err != nil {
		return err
	}
	link := filepath.Join(wants, "carrel-agent.service")
	os.Remove(link)
	return os.Symlink(AgentUnitPath, link)
}

func copyExecutable(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o755)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	if err := out.Close(); err != nil {
		return err
	}
	return os.Chmod(dst, 0o755)
}
