package tests

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/tests/harness"
)

// TestSystemdImage builds a Debian image whose init is systemd from a spec
// of its own, and boots it: carrel-agent, the initramfs's PID 1, sets up
// the verified root and hands over to systemd, which runs carrel-agent
// again as a service (--system). The agent then works as it does as PID 1:
// commands run, each in a cgroup of its own below the service's delegated
// one, with the egress proxies and the image's environment; /workspace is
// the workspace disk; the VM's changes outlive a stop, which systemd
// carries out.
func TestSystemdImage(t *testing.T) {
	d := harness.New(t)
	d.Start()
	buildSystemdImage(t, d)
	start := time.Now()
	d.Must("vm", "create", "sd", "--image", "sysd", "--memory", "1G")
	t.Logf("create to agent-ready took %s", time.Since(start).Round(time.Millisecond))

	if out := d.Must("exec", "sd", "--", "cat", "/proc/1/comm"); out != "systemd\n" {
		t.Errorf("pid 1 is %q, want systemd", out)
	}
	out := d.Must("exec", "sd", "--", "sh", "-c", "cat /proc/self/cgroup; echo env $CARREL_IMAGE $HTTP_PROXY; id -un; grep -E ' / | /workspace ' /proc/mounts")
	for _, want := range []string{
		"0::/system.slice/carrel-agent.service/carrel/", // the command's own cgroup
		"env sysd http://127.0.0.1:3128",
		"\nagent\n",
		"overlay / overlay",
		" /workspace ext4 ",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("no %q in:\n%s", want, out)
		}
	}
	d.Must("exec", "sd", "--", "sh", "-c", "echo kept > /home/agent/kept")
	start = time.Now()
	d.Must("vm", "stop", "sd")
	t.Logf("stop (systemd's power off) took %s", time.Since(start).Round(time.Millisecond))
	if log, _ := os.ReadFile(filepath.Join(d.State, "vms", "sd", "console.log")); !strings.Contains(string(log), "reboot: Power down") {
		t.Errorf("the guest did not power itself off:\n%s", tail(string(log), 15))
	}
	d.Must("vm", "start", "sd")
	if out := d.Must("exec", "sd", "--", "cat", "/home/agent/kept"); out != "kept\n" {
		t.Errorf("after stop and start: %q", out)
	}
}

// systemdSpec is a Debian image whose init is systemd, named sysd.
const systemdSpec = `{
  "name": "sysd",
  "suite": "bookworm",
  "packages": ["bash", "coreutils", "procps"],
  "users": [{"name": "agent", "uid": 1000, "home": "/home/agent", "shell": "/bin/bash"}],
  "env": {"CARREL_IMAGE": "sysd"},
  "init": "systemd"
}
`

// buildSystemdImage builds systemdSpec with d (from the build cache after
// the first time).
func buildSystemdImage(t *testing.T, d *harness.Daemon) {
	t.Helper()
	spec := filepath.Join(t.TempDir(), "systemd.json")
	if err := os.WriteFile(spec, []byte(systemdSpec), 0o644); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if r := d.CarrelTimeout(30*time.Minute, "image", "build", "--spec", spec); r.Code != 0 {
		t.Fatalf("image build --spec: %+v", r)
	}
	t.Logf("image build took %s", time.Since(start).Round(time.Second))
}

// TestImageBuildFails: a spec whose build fails halfway (a package apt
// cannot find) fails with mmdebstrap's reason and leaves no image, no
// half image and no build directory behind.
func TestImageBuildFails(t *testing.T) {
	d := harness.New(t)
	d.Start()
	spec := filepath.Join(t.TempDir(), "bad.json")
	if err := os.WriteFile(spec, []byte(`{"name": "bad", "suite": "bookworm", "packages": ["bash", "carrel-no-such-package"],
  "users": [{"name": "agent", "uid": 1000, "home": "/home/agent", "shell": "/bin/bash"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	before := d.Must("image", "ls")
	r := d.CarrelTimeout(10*time.Minute, "image", "build", "--spec", spec)
	if r.Code == 0 || !strings.Contains(r.Stderr, "mmdebstrap") || !strings.Contains(r.Stderr, "carrel-no-such-package") {
		t.Errorf("a build of a missing package: %+v", r)
	}
	if after := d.Must("image", "ls"); after != before {
		t.Errorf("a failed build changed the store:\n%s\n%s", before, after)
	}
	for _, dir := range []string{filepath.Join(d.State, "images", "tmp"), filepath.Join(harness.CacheDir(), "debian", "images")} {
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), ".build-") || strings.HasPrefix(e.Name(), ".import-") || strings.HasPrefix(e.Name(), ".debian-") {
				t.Errorf("left behind: %s/%s", dir, e.Name())
			}
		}
	}
}
