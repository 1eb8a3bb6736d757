//go:build linux

package agent

import (
	"errors"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"golang.org/x/sys/unix"
)

// useConsole points stdin at /dev/null and stdout and stderr at
// /dev/console, whatever the kernel gave us (which depends on whether the
// initramfs has /dev/console).
func useConsole() error {
	console, err := os.OpenFile("/dev/console", os.O_WRONLY|unix.O_NOCTTY, 0)
	if err != nil {
		return err
	}
	defer console.Close()
	null, err := os.Open(os.DevNull)
	if err != nil {
		return err
	}
	defer null.Close()
	return errors.Join(
		unix.Dup3(int(null.Fd()), 0, 0),
		unix.Dup3(int(console.Fd()), 1, 0),
		unix.Dup3(int(console.Fd()), 2, 0),
	)
}

// ignoreSignals keeps signals that would end the Go program from killing
// PID 1 (which would panic the kernel). Handlers, unlike SIG_IGN, are not
// inherited by the commands we start.
func ignoreSignals(log *slog.Logger) {
	c := make(chan os.Signal, 4)
	signal.Notify(c, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP, syscall.SIGQUIT, syscall.SIGUSR1, syscall.SIGUSR2, syscall.SIGPWR)
	go func() {
		for sig := range c {
			log.Warn("ignoring signal", "signal", sig)
		}
	}()
}
