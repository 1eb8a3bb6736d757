package tests

import (
	"encoding/json"
	"os"
	"testing"

	"github.com/carrel-os/carrel/tests/harness"
)

// TestVsockTransport runs where the host has vhost-vsock: the VM gets a
// vsock device and carreld must reach the agent over it, not the serial
// fallback. This project's CI machines have no /dev/vhost-vsock, so there
// the same protocol is exercised over virtio-serial by every other test.
func TestVsockTransport(t *testing.T) {
	if _, err := os.Stat("/dev/vhost-vsock"); err != nil {
		t.Skip("no /dev/vhost-vsock on this host: the vsock transport is not exercised here (virtio-serial carries the same protocol in the other tests)")
	}
	d := harness.New(t)
	d.Start()
	d.BuildImage()
	d.Must("vm", "create", "vs")
	var v struct {
		Transport string `json:"transport"`
	}
	if err := json.Unmarshal([]byte(d.Must("vm", "inspect", "vs")), &v); err != nil {
		t.Fatal(err)
	}
	if v.Transport != "vsock" {
		t.Errorf("transport = %q, want vsock", v.Transport)
	}
	if out := d.Must("exec", "vs", "--", "echo", "over vsock"); out != "over vsock\n" {
		t.Errorf("exec = %q", out)
	}
	d.Must("vm", "rm", "--force", "vs")
}
