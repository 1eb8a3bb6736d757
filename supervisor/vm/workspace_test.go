package vm

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/image/workspace"
	"github.com/carrel-os/carrel/supervisor/driver"
)

// withWorkspaceImage tags, as "ws", the fake image with a workspace
// template, and returns the template's path in the store.
func (e *env) withWorkspaceImage(t *testing.T) string {
	t.Helper()
	r, err := e.img.Resolve("dev")
	if err != nil {
		t.Fatal(err)
	}
	tpl := filepath.Join(t.TempDir(), "template")
	if err := os.WriteFile(tpl, []byte("a raw ext4 file system"), 0o644); err != nil {
		t.Fatal(err)
	}
	p, err := e.img.PutBlob(tpl)
	if err != nil {
		t.Fatal(err)
	}
	m := *r.Manifest
	m.Workspace = &p
	d, err := e.img.PutManifest(&m)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.img.Tag("ws", d); err != nil {
		t.Fatal(err)
	}
	r, err = e.img.Resolve("ws")
	if err != nil {
		t.Fatal(err)
	}
	return r.WorkspacePath
}

func (e *env) spec(t *testing.T, name string) driver.Spec {
	t.Helper()
	st, err := e.m.Get(name)
	if err != nil || st.Record.Instance == nil {
		t.Fatalf("%s: %+v, %v", name, st, err)
	}
	return e.drv.VM(st.Record.Instance.PID).Spec
}

func TestWorkspaceDisk(t *testing.T) {
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Skip("qemu-img is missing (qemu-utils): run `make deps`")
	}
	e := newEnv(t)
	ctx := context.Background()
	tpl := e.withWorkspaceImage(t)

	// An image without a template: no disk, /workspace stays a tmpfs.
	e.create(t, "mem")
	if s := e.spec(t, "mem"); s.Workspace != "" || strings.Contains(s.Cmdline, protocol.WorkspaceDiskArg) {
		t.Errorf("vm of an image without a template: %+v", s)
	}
	if _, err := os.Stat(filepath.Join(e.reg.Dir("mem"), WorkspaceDiskName)); !os.IsNotExist(err) {
		t.Errorf("disk made for it: %v", err)
	}

	if _, err := e.m.Create(ctx, CreateParams{Name: "disk", Image: "ws", MemoryBytes: 768 << 20}); err != nil {
		t.Fatal(err)
	}
	s := e.spec(t, "disk")
	disk := filepath.Join(e.reg.Dir("disk"), WorkspaceDiskName)
	if s.Workspace != disk || s.WorkspaceTemplate != tpl || !strings.HasSuffix(s.Cmdline, " "+protocol.WorkspaceDiskArg) {
		t.Errorf("spec: %+v", s)
	}
	// Half the memory by default, over the template.
	i, err := workspace.Inspect(ctx, "qemu-img", disk)
	if err != nil || i.VirtualSize != 384<<20 || i.BackingFilename != tpl || i.BackingFormat != "raw" {
		t.Errorf("disk %+v, %v", i, err)
	}
	before, err := os.Stat(disk)
	if err != nil {
		t.Fatal(err)
	}
	// The disk outlives a stop: the next run gets the same one.
	if _, err := e.m.Stop(ctx, "disk", true); err != nil {
		t.Fatal(err)
	}
	if _, err := e.m.Start(ctx, "disk"); err != nil {
		t.Fatal(err)
	}
	after, err := os.Stat(disk)
	if err != nil || !os.SameFile(before, after) {
		t.Errorf("the disk was made again: %v", err)
	}
	if s := e.spec(t, "disk"); s.Workspace != disk || strings.Count(s.Cmdline, protocol.WorkspaceDiskArg) != 1 {
		t.Errorf("spec after restart: %+v", s)
	}

	// A size asked for is the disk's.
	if _, err := e.m.Create(ctx, CreateParams{Name: "sized", Image: "ws", WorkspaceBytes: 64 << 20}); err != nil {
		t.Fatal(err)
	}
	if i, err := workspace.Inspect(ctx, "qemu-img", filepath.Join(e.reg.Dir("sized"), WorkspaceDiskName)); err != nil || i.VirtualSize != 64<<20 {
		t.Errorf("sized disk %+v, %v", i, err)
	}
	// Removing the VM removes its disk.
	if err := e.m.Delete(ctx, "sized", true); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(e.reg.Dir("sized")); !os.IsNotExist(err) {
		t.Errorf("vm dir left: %v", err)
	}
}
