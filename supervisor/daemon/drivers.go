package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/carrel-os/carrel/image/workspace"
	"github.com/carrel-os/carrel/supervisor/driver"
	"github.com/carrel-os/carrel/supervisor/driver/libvirt"
	"github.com/carrel-os/carrel/supervisor/driver/qemu"
)

// Driver names for Config.Driver.
const (
	DriverQEMU    = qemu.Name
	DriverLibvirt = libvirt.Name
)

// newDrivers returns every driver carreld has, as a Set whose default is
// cfg.Driver: new VMs get the default, and each existing VM keeps the
// driver it was created with. The libvirt driver connects to libvirtd
// only when used, except when it is the default: then carreld checks that
// it can reach libvirtd before it serves. close ends the connection.
func newDrivers(ctx context.Context, cfg Config, accelerator string, log *slog.Logger) (set *driver.Set, close func() error, err error) {
	q := qemu.New(qemu.Config{Binary: cfg.QEMUBinary, Machine: cfg.Machine, Accelerator: accelerator, Logger: log.With("subsystem", "qemu"), Cgroups: true})
	l, err := libvirt.New(libvirt.Config{URI: cfg.LibvirtURI, Accelerator: accelerator, Logger: log.With("subsystem", "libvirt"), QEMUImg: workspace.QEMUImg(cfg.QEMUBinary)})
	if err != nil {
		return nil, nil, err
	}
	switch cfg.Driver {
	case "", DriverQEMU:
		log.Info("driver chosen", "driver", DriverQEMU, "machine", q.Machine())
		return driver.NewSet(q, l), l.Close, nil
	case DriverLibvirt:
		pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		version, err := l.Ping(pctx)
		if err != nil {
			return nil, nil, fmt.Errorf("--driver libvirt: %w", err)
		}
		log.Info("driver chosen", "driver", DriverLibvirt, "uri", cfg.LibvirtURI, "libvirt", version)
		return driver.NewSet(l, q), l.Close, nil
	}
	return nil, nil, fmt.Errorf("unknown driver %q: use %s or %s", cfg.Driver, DriverQEMU, DriverLibvirt)
}
