package vm

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/image/store"
	"github.com/carrel-os/carrel/image/verity"
	"github.com/carrel-os/carrel/image/workspace"
	"github.com/carrel-os/carrel/supervisor/driver"
	"github.com/carrel-os/carrel/supervisor/registry"
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
	if s := e.spec(t, "mem"); len(s.Disks) != 0 || strings.Contains(s.Cmdline, protocol.WorkspaceDiskArg) {
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
	want := driver.Disk{Path: disk, Format: driver.FormatQCOW2, Backing: tpl, Serial: protocol.WorkspaceSerial}
	if len(s.Disks) != 1 || !reflect.DeepEqual(s.Disks[0], want) || !strings.HasSuffix(s.Cmdline, " "+protocol.WorkspaceDiskArg) {
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
	if s := e.spec(t, "disk"); len(s.Disks) != 1 || s.Disks[0].Path != disk || strings.Count(s.Cmdline, protocol.WorkspaceDiskArg) != 1 {
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

// withSystemImage tags, as "sys", an image with a verified root (its
// parts are filler: the fake driver boots nothing) and, if workspace, a
// workspace template.
func (e *env) withSystemImage(t *testing.T, workspace bool) *store.Resolved {
	t.Helper()
	r, err := e.img.Resolve("dev")
	if err != nil {
		t.Fatal(err)
	}
	put := func(name string, size int64) manifest.Part {
		p := filepath.Join(t.TempDir(), name)
		if err := os.WriteFile(p, bytes.Repeat([]byte(name[:1]), int(size)), 0o644); err != nil {
			t.Fatal(err)
		}
		part, err := e.img.PutBlob(p)
		if err != nil {
			t.Fatal(err)
		}
		return part
	}
	v := manifest.Verity{Mount: manifest.MountRoot, RootHash: strings.Repeat("ab", 32), HashAlg: "sha256",
		DataBlockSize: 4096, HashBlockSize: 4096, DataBlocks: 4, Salt: "", UUID: "6361726c-0000-8000-8000-000000000001"}
	p, _, err := v.Params()
	if err != nil {
		t.Fatal(err)
	}
	m := *r.Manifest
	sys, hash := put("system", 4*4096), put("verity", verity.HashSize(p))
	m.System, m.SystemVerity, m.Verity = &sys, &hash, &v
	m.Cmdline += " roothash=" + v.RootHash
	if workspace {
		ws := put("template", 4096)
		m.Workspace = &ws
	}
	d, err := e.img.PutManifest(&m)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.img.Tag("sys", d); err != nil {
		t.Fatal(err)
	}
	if r, err = e.img.Resolve("sys"); err != nil {
		t.Fatal(err)
	}
	return r
}

func TestVerifiedRootDisks(t *testing.T) {
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Skip("qemu-img is missing (qemu-utils): run `make deps`")
	}
	e := newEnv(t)
	e.m = New(Config{Registry: e.reg, Images: e.img, Driver: e.drv, BootTimeout: 2 * time.Second, StopTimeout: time.Second,
		DiskTemplate: filepath.Join(e.dir, "disk-template.img")})
	ctx := context.Background()
	img := e.withSystemImage(t, false)

	rec, err := e.m.Create(ctx, CreateParams{Name: "a", Image: "sys"})
	if err != nil {
		t.Fatal(err)
	}
	if rec.RootHash != img.Manifest.Verity.RootHash {
		t.Errorf("record's root hash %q", rec.RootHash)
	}
	s := e.spec(t, "a")
	state := filepath.Join(e.reg.Dir("a"), StateDiskName)
	tpl := filepath.Join(e.dir, "disk-template.img")
	want := []driver.Disk{
		{Path: img.SystemPath, Format: driver.FormatRaw, ReadOnly: true, Serial: protocol.SystemSerial},
		{Path: img.SystemVerityPath, Format: driver.FormatRaw, ReadOnly: true, Serial: protocol.SystemVeritySerial},
		{Path: state, Format: driver.FormatQCOW2, Backing: tpl, Serial: protocol.StateSerial},
	}
	if !reflect.DeepEqual(s.Disks, want) || !strings.Contains(s.Cmdline, " carrel.state=disk") {
		t.Fatalf("spec: %+v", s)
	}
	// The image brings no template, so carreld made its own, read-only.
	if fi, err := os.Stat(tpl); err != nil || fi.Mode().Perm() != 0o444 {
		t.Errorf("template: %v, %v", fi, err)
	}
	if i, err := workspace.Inspect(ctx, "qemu-img", state); err != nil || i.VirtualSize != DefaultStateBytes || i.BackingFilename != tpl {
		t.Errorf("state disk %+v, %v", i, err)
	}

	// --disk sizes it; --ephemeral has none, and says so to the guest.
	if _, err := e.m.Create(ctx, CreateParams{Name: "sized", Image: "sys", DiskBytes: 1 << 30}); err != nil {
		t.Fatal(err)
	}
	if i, err := workspace.Inspect(ctx, "qemu-img", filepath.Join(e.reg.Dir("sized"), StateDiskName)); err != nil || i.VirtualSize != 1<<30 {
		t.Errorf("sized state disk %+v, %v", i, err)
	}
	if _, err := e.m.Create(ctx, CreateParams{Name: "eph", Image: "sys", Ephemeral: true}); err != nil {
		t.Fatal(err)
	}
	if s := e.spec(t, "eph"); len(s.Disks) != 2 || !strings.Contains(s.Cmdline, " carrel.state=memory") {
		t.Errorf("ephemeral spec: %+v", s)
	}
	if _, err := os.Stat(filepath.Join(e.reg.Dir("eph"), StateDiskName)); !os.IsNotExist(err) {
		t.Errorf("ephemeral vm got a state disk: %v", err)
	}
	for _, bad := range []CreateParams{
		{Name: "b1", Image: "sys", Ephemeral: true, DiskBytes: 1 << 30},
		{Name: "b2", Image: "sys", DiskBytes: 1 << 20},
		{Name: "b3", Image: "sys", DiskBytes: 2<<40 + 1<<20},
		{Name: "b4", Image: "sys", DiskBytes: 1<<30 + 1},
	} {
		if _, err := e.m.Create(ctx, bad); !errors.Is(err, ErrInvalid) {
			t.Errorf("%+v: %v", bad, err)
		}
	}
}

func TestReset(t *testing.T) {
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Skip("qemu-img is missing (qemu-utils): run `make deps`")
	}
	e := newEnv(t)
	var events []EventKind
	e.m = New(Config{Registry: e.reg, Images: e.img, Driver: e.drv, BootTimeout: 2 * time.Second, StopTimeout: time.Second,
		OnEvent: func(_ context.Context, ev Event) error { events = append(events, ev.Kind); return nil }})
	ctx := context.Background()
	e.withSystemImage(t, true)
	rec, err := e.m.Create(ctx, CreateParams{Name: "a", Image: "sys"})
	if err != nil {
		t.Fatal(err)
	}
	dir := e.reg.Dir("a")
	state, ws := filepath.Join(dir, StateDiskName), filepath.Join(dir, WorkspaceDiskName)
	stat := func(p string) os.FileInfo {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		return fi
	}
	stat(state)
	ws0 := stat(ws)

	// Running: stopped, the layer discarded, booted again in a new session.
	events = nil
	got, err := e.m.Reset(ctx, "a", false)
	if err != nil {
		t.Fatal(err)
	}
	if got.State != registry.StateRunning || got.Session == rec.Session {
		t.Errorf("after reset: %+v", got)
	}
	if _, err := os.Stat(state); !os.IsNotExist(err) {
		t.Errorf("the old state disk is still there: %v", err)
	}
	// The new disk has a name no earlier file had: a snapshot may keep
	// the old one.
	newState := filepath.Join(dir, diskName(got, protocol.StateSerial))
	if newState == state || !os.SameFile(ws0, stat(ws)) {
		t.Error("reset kept the state disk or made a new workspace")
	}
	state = newState
	if !slices.Contains(events, EventReset) || !slices.Contains(events, EventStarted) {
		t.Errorf("events %v", events)
	}

	// Stopped, with --workspace: both go, and it stays stopped.
	if _, err := e.m.Stop(ctx, "a", true); err != nil {
		t.Fatal(err)
	}
	got, err = e.m.Reset(ctx, "a", true)
	if err != nil || got.State != registry.StateStopped {
		t.Fatalf("reset stopped vm: %+v, %v", got, err)
	}
	for _, p := range []string{state, ws} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("%s kept: %v", p, err)
		}
	}
	// A reset that cannot be recorded discards nothing.
	d := e.reg.Dir("a")
	e.m.Close()
	e.m = New(Config{Registry: e.reg, Images: e.img, Driver: e.drv, BootTimeout: 2 * time.Second, StopTimeout: time.Second,
		OnEvent: func(_ context.Context, ev Event) error {
			if ev.Kind == EventReset {
				return errors.New("audit log full")
			}
			return nil
		}})
	if err := e.m.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := e.m.Start(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.m.Reset(ctx, "a", false); err == nil || !strings.Contains(err.Error(), "audit log full") {
		t.Errorf("reset without its record: %v", err)
	}
	r, _ := e.reg.Get("a")
	if _, err := os.Stat(filepath.Join(d, diskName(*r, protocol.StateSerial))); err != nil {
		t.Errorf("the state disk went without a record: %v", err)
	}
	if _, err := e.m.Reset(ctx, "nope", false); !errors.Is(err, ErrNotFound) {
		t.Errorf("reset of an unknown vm: %v", err)
	}
}

// TestHostileLayerRefused: a disk whose qcow2 header (which the VM's QEMU
// writes) names another VM's disk as a layer does not start: that VM's
// disk would be shown to it.
func TestHostileLayerRefused(t *testing.T) {
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Skip("qemu-img is missing (qemu-utils): run `make deps`")
	}
	e := newEnv(t)
	e.m = New(Config{Registry: e.reg, Images: e.img, Driver: e.drv, BootTimeout: 2 * time.Second, StopTimeout: time.Second,
		DiskTemplate: filepath.Join(e.dir, "disk-template.img")})
	ctx := context.Background()
	e.withSystemImage(t, false)
	for _, n := range []string{"a", "b"} {
		if _, err := e.m.Create(ctx, CreateParams{Name: n, Image: "sys"}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := e.m.Stop(ctx, "a", true); err != nil {
		t.Fatal(err)
	}
	// a's state disk now stands on b's, which stands on the template.
	disk, victim := filepath.Join(e.reg.Dir("a"), StateDiskName), filepath.Join(e.reg.Dir("b"), StateDiskName)
	os.Remove(disk)
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-u", "-F", "qcow2", "-b", victim, disk, "1G").CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	_, err := e.m.Start(ctx, "a")
	if err == nil || !strings.Contains(err.Error(), "lies outside the directories of vm \"a\"") {
		t.Fatalf("a start over b's disk: %v", err)
	}
}
