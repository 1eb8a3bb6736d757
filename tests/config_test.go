package tests

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/tests/harness"
)

// TestConfigFile: carreld takes its settings from --config, a flag on the
// command line wins over the file, and a bad file stops carreld, saying
// what is wrong with it.
func TestConfigFile(t *testing.T) {
	// The test picks the driver itself, on the command line.
	harness.RequireDriver(t, "qemu")
	dir := t.TempDir()
	config := filepath.Join(dir, "carreld.json")
	// The libvirt URI is one no libvirtd answers on: were the file's driver
	// chosen, carreld would fail to start.
	err := os.WriteFile(config, []byte(`{"driver": "libvirt", "libvirt-uri": "qemu:///system?socket=/nonexistent", "machine": "microvm"}`), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	d := harness.New(t, "--config", config, "--driver", "qemu")
	d.Start()
	if !strings.Contains(d.Logs(), `msg="driver chosen" driver=qemu machine=microvm`) {
		t.Errorf("want the qemu driver from the command line and microvm from the file:\n%s", d.Logs())
	}
	d.Stop()

	bad := filepath.Join(dir, "bad.json")
	if err := os.WriteFile(bad, []byte(`{"drvier": "libvirt"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(filepath.Join(harness.Bins(t), "carreld"), "--config", bad, "--state-dir", filepath.Join(dir, "s")).CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 2 || !strings.Contains(string(out), `bad.json: unknown setting "drvier"`) {
		t.Errorf("carreld with a bad config file: %v\n%s", err, out)
	}
	if _, err := os.Stat(filepath.Join(dir, "s")); !os.IsNotExist(err) {
		t.Errorf("carreld made its state dir before refusing its config: %v", err)
	}
}
