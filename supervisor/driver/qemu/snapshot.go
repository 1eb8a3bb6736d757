package qemu

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/digitalocean/go-qemu/qmp"

	"github.com/carrel-os/carrel/image/workspace"
	"github.com/carrel-os/carrel/supervisor/driver"
)

var _ driver.Snapshotter = (*Driver)(nil)

// migrateSocketName is where carreld listens for the state QEMU saves.
const migrateSocketName = "migrate.sock"

// run sends one QMP command with its arguments (nil for none) and decodes
// its "return" into out (nil to ignore it). A QMP error is returned as
// the command's error, with QEMU's description.
func run(mon qmp.Monitor, cmd string, args, out any) error {
	req := map[string]any{"execute": cmd}
	if args != nil {
		req["arguments"] = args
	}
	b, err := json.Marshal(req)
	if err != nil {
		return err
	}
	raw, err := mon.Run(b)
	if err != nil {
		return fmt.Errorf("qmp %s: %w", cmd, err)
	}
	if out == nil {
		return nil
	}
	var resp struct {
		Return json.RawMessage `json:"return"`
	}
	if err := json.Unmarshal(raw, &resp); err != nil {
		return fmt.Errorf("qmp %s: %w", cmd, err)
	}
	if err := json.Unmarshal(resp.Return, out); err != nil {
		return fmt.Errorf("qmp %s: %w", cmd, err)
	}
	return nil
}

// FreezeDisks implements driver.Snapshotter with one QMP transaction of
// blockdev-snapshot-sync actions: QEMU makes each new overlay, naming the
// current file as its backing by its absolute path, and switches to it.
// The files are never renamed: QEMU opens a node's file again by its name
// when the node's permissions change (the old top becomes read-only), so a
// renamed file would be replaced by whatever took its name.
func (d *Driver) FreezeDisks(ctx context.Context, inst driver.Instance, overlays map[string]string) error {
	return d.rawMonitor(ctx, inst.QMPSocket, func(mon qmp.Monitor) error {
		var blocks []struct {
			Device   string `json:"device"`
			Inserted *struct {
				File  string `json:"file"`
				Image struct {
					VirtualSize uint64 `json:"virtual-size"`
				} `json:"image"`
			} `json:"inserted"`
		}
		if err := run(mon, "query-block", nil, &blocks); err != nil {
			return err
		}
		type disk struct {
			device string
			size   uint64
		}
		byFile := map[string]disk{}
		for _, b := range blocks {
			if b.Inserted != nil {
				byFile[b.Inserted.File] = disk{b.Device, b.Inserted.Image.VirtualSize}
			}
		}
		var actions []any
		for cur, next := range overlays {
			dev, ok := byFile[cur]
			if !ok {
				return fmt.Errorf("the vm has no disk open at %s", cur)
			}
			mode := "absolute-paths"
			if inst.UID != 0 {
				// A jailed QEMU cannot make files in the VM's directory:
				// carreld makes the overlay, QEMU's user's, and QEMU
				// opens it.
				if err := workspace.Overlay(ctx, d.cfg.QEMUImg, next, cur, dev.size); err != nil {
					return err
				}
				if err := giveDisk(next, inst.UID); err != nil {
					return err
				}
				mode = "existing"
			}
			actions = append(actions, map[string]any{"type": "blockdev-snapshot-sync", "data": map[string]any{
				"device": dev.device, "snapshot-file": next, "format": driver.FormatQCOW2, "mode": mode,
			}})
		}
		if len(actions) == 0 {
			return nil
		}
		if err := run(mon, "transaction", map[string]any{"actions": actions}, nil); err != nil {
			return err
		}
		if inst.UID != 0 {
			// The frozen layers are QEMU's no more: the snapshot stands
			// on them.
			for cur := range overlays {
				if err := readableByAll(cur); err != nil {
					return fmt.Errorf("take back the frozen layer: %w", err)
				}
			}
		}
		return nil
	})
}

// SaveState implements driver.Snapshotter. QEMU migrates to a unix socket
// carreld listens on in the VM's directory, and carreld copies what comes
// to the file, at most max bytes. Without -sandbox's spawn, QEMU cannot
// run a helper to write a file, and a socket keeps the bytes in carreld's
// hands. After a save QEMU waits in "postmigrate": Resume continues the
// VM.
func (d *Driver) SaveState(ctx context.Context, inst driver.Instance, path string, max int64) (int64, error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o400)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	w := driver.LimitWriter(f, max)
	sock := filepath.Join(filepath.Dir(inst.QMPSocket), migrateSocketName)
	_ = os.Remove(sock)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		return 0, fmt.Errorf("listen for the vm's state: %w", err)
	}
	defer ln.Close()
	if inst.UID != 0 {
		// Connecting takes write permission on the socket.
		if err := os.Chown(sock, int(inst.UID), int(inst.UID)); err != nil {
			return 0, err
		}
	}
	type copied struct {
		n   int64
		err error
	}
	got := make(chan copied, 1)
	go func() {
		c, err := ln.AcceptUnix()
		if err != nil {
			got <- copied{err: err}
			return
		}
		defer c.Close()
		n, err := io.Copy(w, c)
		got <- copied{n, err}
	}()
	err = d.rawMonitor(ctx, inst.QMPSocket, func(mon qmp.Monitor) error {
		// QEMU's default bandwidth cap (32 MiB/s) is for a network.
		if err := run(mon, "migrate-set-parameters", map[string]any{"max-bandwidth": int64(1) << 40}, nil); err != nil {
			return err
		}
		return run(mon, "migrate", map[string]any{"uri": "unix:" + sock}, nil)
	})
	if err != nil {
		return 0, err
	}
	// The stream ends when QEMU is done; its status says how.
	var res copied
	select {
	case res = <-got:
	case <-ctx.Done():
		_ = d.rawMonitor(context.Background(), inst.QMPSocket, func(mon qmp.Monitor) error { return run(mon, "migrate_cancel", nil, nil) })
		ln.Close()
		return 0, fmt.Errorf("save vm state: %w", ctx.Err())
	}
	status, err := d.migrateStatus(ctx, inst.QMPSocket)
	if err != nil {
		return res.n, err
	}
	if res.err != nil {
		return res.n, fmt.Errorf("save vm state: %w (qemu says %s)", res.err, status)
	}
	if status != "completed" {
		return res.n, fmt.Errorf("save vm state: qemu's migration ended %s", status)
	}
	return res.n, f.Close()
}

// migrateStatus waits for QEMU's migration to leave its running states
// and returns how it ended ("completed", or "failed: why").
func (d *Driver) migrateStatus(ctx context.Context, socket string) (string, error) {
	for {
		var st struct {
			Status string `json:"status"`
			Error  string `json:"error-desc"`
		}
		err := d.rawMonitor(ctx, socket, func(mon qmp.Monitor) error { return run(mon, "query-migrate", nil, &st) })
		if err != nil {
			return "", err
		}
		switch st.Status {
		case "completed":
			return st.Status, nil
		case "failed", "cancelled":
			return st.Status + ": " + st.Error, nil
		}
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// awaitIncoming waits until QEMU has loaded the state it was started
// with (-incoming) and stands paused, racing its exit: QEMU exits when the
// state does not load.
func (d *Driver) awaitIncoming(ctx context.Context, socket string, exited <-chan struct{}) error {
	for {
		var st struct {
			Status string `json:"status"`
		}
		err := d.rawMonitor(ctx, socket, func(mon qmp.Monitor) error { return run(mon, "query-status", nil, &st) })
		select {
		case <-exited:
			return errors.New("qemu exited while loading the saved state: it is damaged or from another machine")
		default:
		}
		if err != nil {
			return fmt.Errorf("qemu did not load the saved state: %w", err)
		}
		if st.Status != "inmigrate" {
			if st.Status != "paused" {
				return fmt.Errorf("qemu is %s after loading the saved state, want paused", st.Status)
			}
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("qemu did not load the saved state: %w", ctx.Err())
		case <-exited:
			return errors.New("qemu exited while loading the saved state: it is damaged or from another machine")
		case <-time.After(10 * time.Millisecond):
		}
	}
}
