package qemu

import (
	"context"
	"encoding/binary"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/supervisor/driver"
)

// haltKernel is a multiboot image loaded at 1 MiB that halts forever
// (hlt; jmp back to hlt), so that QEMU runs a guest without an image
// build.
var haltKernel = func() []byte {
	const magic, flags, base uint32 = 0x1BADB002, 0x00010000, 0x100000
	sum := magic + flags
	img := make([]byte, 64)
	for i, v := range []uint32{magic, flags, -sum, base, base, 0, 0, base + 32} {
		binary.LittleEndian.PutUint32(img[4*i:], v)
	}
	copy(img[32:], []byte{0xF4, 0xEB, 0xFD})
	return img
}()

// TestRestoreNeedsTheSavedPorts: QEMU loads a saved state only into a VM
// with the virtio-serial ports it was saved with, so a state saved without
// the data port (before there was one) restores with Spec.NoDataPort and
// fails without it, and the other way round.
func TestRestoreNeedsTheSavedPorts(t *testing.T) {
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("qemu-system-x86_64 not installed: run `make deps`")
	}
	ctx := context.Background()
	d := New(Config{Accelerator: "tcg"})
	// Short: the sockets must fit in sun_path.
	root, err := os.MkdirTemp("/tmp", "cq-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	kernel, initrd := filepath.Join(root, "kernel"), filepath.Join(root, "initrd")
	if err := os.WriteFile(kernel, haltKernel, 0o400); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(initrd, []byte("initrd"), 0o400); err != nil {
		t.Fatal(err)
	}
	n := 0
	start := func(noData bool, incoming *os.File) (driver.Instance, error) {
		n++
		dir := filepath.Join(root, strings.Repeat("v", n))
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		spec := driver.Spec{Name: "v", Kernel: kernel, Initrd: initrd, MemoryBytes: 64 << 20, CPUs: 1, Dir: dir, Incoming: incoming, NoDataPort: noData}
		inst, err := d.Start(ctx, spec)
		if err == nil {
			t.Cleanup(func() { d.Kill(context.Background(), inst) })
		}
		return inst, err
	}
	save := func(noData bool) *os.File {
		inst, err := start(noData, nil)
		if err != nil {
			t.Fatal(err)
		}
		if (inst.DataSocket == "") != noData {
			t.Errorf("NoDataPort %v: data socket %q", noData, inst.DataSocket)
		}
		if err := d.Resume(ctx, inst); err != nil {
			t.Fatal(err)
		}
		if err := d.Pause(ctx, inst); err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(inst.AgentSocket, "..", "state")
		if _, err := d.SaveState(ctx, inst, path, 1<<30); err != nil {
			t.Fatal(err)
		}
		if err := d.Kill(ctx, inst); err != nil {
			t.Fatal(err)
		}
		f, err := os.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f
	}
	states := map[bool]*os.File{true: save(true), false: save(false)}
	for _, saved := range []bool{true, false} {
		for _, restored := range []bool{true, false} {
			inst, err := start(restored, states[saved])
			if saved == restored {
				if err != nil {
					t.Errorf("saved with NoDataPort %v, restored the same: %v", saved, err)
				} else if (inst.DataSocket == "") != restored {
					t.Errorf("restored with NoDataPort %v: data socket %q", restored, inst.DataSocket)
				}
			} else if err == nil || !strings.Contains(err.Error(), "virtio-console") {
				t.Errorf("saved with NoDataPort %v, restored with %v: %v, want qemu's refusal of the virtio-serial device", saved, restored, err)
			}
		}
	}
}
