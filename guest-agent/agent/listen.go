//go:build linux

package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"time"

	"github.com/carrel-os/carrel/guest-agent/transport"
)

// deviceWait bounds how long we wait for the transport's device to appear
// after its module loads (probing is asynchronous).
const deviceWait = 2 * time.Second

// listen listens on cfg's transport, choosing one for Auto, and returns
// the listener with the transport's name as Health reports it.
func listen(ctx context.Context, log *slog.Logger, cfg Config) (net.Listener, string, error) {
	kind := cfg.Transport
	if kind == Auto {
		var err error
		if kind, err = transport.Detect(ctx, cfg.SerialName, deviceWait); err != nil {
			return nil, "", err
		}
	}
	switch kind {
	case transport.Vsock:
		l, err := transport.ListenVsock(cfg.VsockPort, log)
		return l, transport.Vsock, err
	case "serial", transport.Serial:
		// Wait for the port (and its name) to show up.
		wctx, cancel := context.WithTimeout(ctx, deviceWait)
		defer cancel()
		for {
			_, err := transport.FindSerialPort(cfg.SerialName)
			if err == nil || wctx.Err() != nil {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		l, err := transport.ListenSerial(cfg.SerialName)
		return l, transport.Serial, err
	case transport.Unix:
		if cfg.PID1 || cfg.Listen == "" {
			return nil, "", errors.New("--transport unix needs --listen and is for development hosts only")
		}
		if fi, err := os.Lstat(cfg.Listen); err == nil && fi.Mode()&os.ModeSocket != 0 {
			os.Remove(cfg.Listen) // stale socket from an earlier run
		}
		l, err := net.Listen("unix", cfg.Listen)
		return l, transport.Unix, err
	}
	return nil, "", fmt.Errorf("unknown transport %q", cfg.Transport)
}
