package harness

import (
	"errors"
	"os/exec"
	"strings"

	"github.com/carrel-os/carrel/supervisor/driver/libvirt/libvirttest"
)

// LibvirtURI is the libvirt connection the end-to-end tests use.
const LibvirtURI = "qemu:///system"

// StartLibvirt makes sure the system libvirtd answers, starting virtlogd
// and libvirtd when their sockets do not (nothing starts services on the
// build and CI machines). It installs nothing: when libvirt is missing or
// the test is not root it skips, or fails under CARREL_REQUIRE_VM=1,
// where `make deps` has installed libvirt-daemon-system.
func StartLibvirt(t TB) {
	t.Helper()
	RequireVM(t)
	err := libvirttest.Ensure()
	if errors.Is(err, libvirttest.ErrUnavailable) {
		Unavailable(t, err.Error()+": run `make deps` as root")
	}
	if err != nil {
		t.Fatal(err)
	}
	if _, err := exec.LookPath("virsh"); err != nil {
		t.Fatal("libvirtd runs but virsh is missing: install libvirt-clients")
	}
}

// Virsh runs virsh against LibvirtURI and returns its trimmed output.
func Virsh(args ...string) (string, error) {
	out, err := exec.Command("virsh", append([]string{"-c", LibvirtURI}, args...)...).CombinedOutput()
	s := strings.TrimSpace(string(out))
	if err != nil {
		return s, errors.New("virsh " + strings.Join(args, " ") + ": " + err.Error() + ": " + s)
	}
	return s, nil
}

// MustVirsh is Virsh that fails the test on error.
func MustVirsh(t TB, args ...string) string {
	t.Helper()
	out, err := Virsh(args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}
