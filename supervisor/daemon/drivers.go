package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"os"
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
	jail, err := qemuJail(cfg, log)
	if err != nil {
		return nil, nil, err
	}
	q := qemu.New(qemu.Config{Binary: cfg.QEMUBinary, Machine: cfg.Machine, Accelerator: accelerator, Logger: log.With("subsystem", "qemu"), Cgroups: true,
		Jail: jail, QEMUImg: workspace.QEMUImg(cfg.QEMUBinary)})
	if jail != nil {
		try, err := os.MkdirTemp(cfg.StateDir, ".jail-check-")
		if err == nil {
			err = q.CheckJail(try)
			os.RemoveAll(try)
		}
		if err != nil {
			return nil, nil, fmt.Errorf("%w; or run carreld with --jail-qemu=false, and QEMU as root", err)
		}
	}
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

// qemuJail is the qemu driver's jail as cfg asks for it: nil when it is
// off, or carreld is not root and so cannot make one.
func qemuJail(cfg Config, log *slog.Logger) (*qemu.Jail, error) {
	if !cfg.JailQEMU {
		log.Warn("qemu runs as carreld's user, not jailed (--jail-qemu=false)")
		return nil, nil
	}
	if os.Geteuid() != 0 {
		log.Warn("qemu runs as carreld's user, not jailed: jails need carreld to run as root")
		return nil, nil
	}
	self, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("the qemu jail: find carreld's binary: %w", err)
	}
	j := &qemu.Jail{Helper: self, UIDBase: cfg.JailUIDBase, UIDs: qemu.DefaultUIDs}
	if j.UIDBase == 0 {
		j.UIDBase = qemu.DefaultUIDBase
	}
	if err := j.CheckUIDs(); err != nil {
		return nil, fmt.Errorf("the qemu jail: %w (--jail-uid-base)", err)
	}
	log.Info("each qemu runs as a user of its own, jailed", "uids", fmt.Sprintf("%d-%d", j.UIDBase, j.UIDBase+j.UIDs-1))
	return j, nil
}
