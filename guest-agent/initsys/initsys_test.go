//go:build linux

package initsys

import (
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func discard() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func TestParseModuleList(t *testing.T) {
	in := `# transport modules
/lib/modules/6.1.0/kernel/drivers/virtio/virtio.ko

  /lib/modules/6.1.0/kernel/drivers/char/virtio_console.ko.xz  
relative/vsock.ko
/lib/modules/6.1.0/kernel/net/vmw_vsock/vsock.ko`
	got, err := ParseModuleList(strings.NewReader(in))
	want := []string{
		"/lib/modules/6.1.0/kernel/drivers/virtio/virtio.ko",
		"/lib/modules/6.1.0/kernel/drivers/char/virtio_console.ko.xz",
		"/lib/modules/6.1.0/kernel/net/vmw_vsock/vsock.ko",
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("got %q, want %q", got, want)
	}
	if err == nil || !strings.Contains(err.Error(), "line 5") {
		t.Errorf("err %v, want one about line 5", err)
	}
}

func TestLoadModulesInOrderAndContinues(t *testing.T) {
	list := filepath.Join(t.TempDir(), "modules")
	os.WriteFile(list, []byte("/m/a.ko\n/m/bad.ko\n/m/c.ko\n"), 0o644)
	var loaded []string
	n := loadModules(discard(), list, func(p string) error {
		loaded = append(loaded, p)
		if p == "/m/bad.ko" {
			return errors.New("boom")
		}
		return nil
	})
	if n != 2 || !reflect.DeepEqual(loaded, []string{"/m/a.ko", "/m/bad.ko", "/m/c.ko"}) {
		t.Fatalf("loaded %d: %q", n, loaded)
	}
	if n := loadModules(discard(), filepath.Join(t.TempDir(), "missing"), nil); n != 0 {
		t.Fatalf("missing list loaded %d", n)
	}
}

func TestFinitModuleMissingFile(t *testing.T) {
	if err := finitModule(filepath.Join(t.TempDir(), "nope.ko")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("err %v, want not exist", err)
	}
}

func TestReadHostname(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "hostname")
	os.WriteFile(p, []byte("  carrel-vm \nignored\n"), 0o644)
	if got, err := readHostname(p); got != "carrel-vm" || err != nil {
		t.Errorf("got %q, %v", got, err)
	}
	if got, err := readHostname(filepath.Join(dir, "missing")); got != "" || err != nil {
		t.Errorf("missing: %q, %v", got, err)
	}
	os.WriteFile(p, []byte(strings.Repeat("x", 65)), 0o644)
	if _, err := readHostname(p); err == nil {
		t.Error("65-byte hostname accepted")
	}
}

// The PID-1 entry points must refuse to run anywhere else: on a
// development host they would unmount nothing but kill everything.
func TestRefusesUnlessPID1(t *testing.T) {
	if os.Getpid() == 1 {
		t.Skip("running as pid 1")
	}
	for name, f := range map[string]func(*slog.Logger) error{"Setup": Setup, "PowerOff": PowerOff, "Reboot": Reboot} {
		if err := f(discard()); !errors.Is(err, ErrNotInit) {
			t.Errorf("%s: %v, want ErrNotInit", name, err)
		}
	}
}
