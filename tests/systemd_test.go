package tests

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/tests/harness"
)

// TestSocketActivation starts carreld as systemd would with carreld.socket:
// the API socket is passed in as fd 3, and the first client's connection,
// queued before carreld even ran, is served.
func TestSocketActivation(t *testing.T) {
	if _, err := exec.LookPath("systemd-socket-activate"); err != nil {
		t.Skip("systemd-socket-activate is missing (package systemd): socket activation not exercised")
	}
	d := harness.New(t)
	d.StartSocketActivated()
	out := d.Must("info")
	if !strings.Contains(out, `"version"`) {
		t.Errorf("info = %s", out)
	}
	if !strings.Contains(d.Logs(), "using socket-activated listener") {
		t.Errorf("carreld did not use the passed socket:\n%s", d.Logs())
	}
}
