//go:build linux

package transport

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Transport names, as Health reports them.
const (
	Vsock  = "vsock"
	Serial = "virtio-serial"
	Unix   = "unix"
)

// ErrNotFound reports that a transport's device is not present.
var ErrNotFound = errors.New("device not found")

// Detect returns Vsock if the VM has a vsock device, else Serial if it has
// the virtio-serial port named serialName. Devices are probed
// asynchronously after their modules load, so Detect polls for up to wait
// before it gives up with ErrNotFound.
func Detect(ctx context.Context, serialName string, wait time.Duration) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		if CheckVsock() == nil {
			return Vsock, nil
		}
		if _, err := FindSerialPort(serialName); err == nil {
			return Serial, nil
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("no vsock device and no virtio-serial port %q after %v: %w", serialName, wait, ErrNotFound)
		case <-tick.C:
		}
	}
}
