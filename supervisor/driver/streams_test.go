package driver_test

import (
	"context"
	"net"
	"path/filepath"
	"testing"

	"github.com/carrel-os/carrel/supervisor/driver"
)

// TestDataDialer: a virtio-serial VM's data port is its DataSocket; a
// vsock VM, or one without the port, has none.
func TestDataDialer(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "data.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	dial := driver.DataDialer(driver.Instance{DataSocket: sock})
	if dial == nil {
		t.Fatal("no dialer for a data socket")
	}
	c, err := dial(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if driver.DataDialer(driver.Instance{DataSocket: sock, CID: 3}) != nil {
		t.Error("a vsock vm got a data dialer")
	}
	if driver.DataDialer(driver.Instance{}) != nil {
		t.Error("a vm without a data port got a data dialer")
	}
}
