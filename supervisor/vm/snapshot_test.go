package vm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/driver"
	"github.com/carrel-os/carrel/supervisor/driver/drivertest"
	"github.com/carrel-os/carrel/supervisor/registry"
)

// TestSnapshotRestoreFork walks snapshots through the manager on the fake
// driver, with real qcow2 files: what a snapshot freezes and moves, what a
// restore and a fork start from and tell the guest, what cannot be
// deleted from under a fork, and what a failure leaves.
func TestSnapshotRestoreFork(t *testing.T) {
	e := newEnv(t)
	l := &eventLog{}
	e.withEvents(l)
	e.withSystemImage(t, true)
	ctx := context.Background()
	a, err := e.m.Create(ctx, CreateParams{Name: "a", Image: "sys"})
	if err != nil {
		t.Fatal(err)
	}
	dir := e.reg.Dir("a")

	s1, err := e.m.Snapshot(ctx, "a", SnapshotParams{Name: "s1", Note: "first"})
	if err != nil {
		t.Fatal(err)
	}
	if len(s1.Disks) != 2 || s1.State.Bytes == 0 || s1.Session != a.Session || s1.Note != "first" {
		t.Fatalf("snapshot %+v", s1)
	}
	for _, d := range s1.Disks {
		if fi, err := os.Stat(d.Path); err != nil || fi.Mode().Perm() != 0o444 {
			t.Errorf("frozen layer %s: %v %v", d.Path, fi.Mode(), err)
		}
	}
	rec, _ := e.m.Get("a")
	for _, serial := range writableSerials {
		n := diskName(rec.Record, serial)
		if n == StateDiskName || n == WorkspaceDiskName {
			t.Errorf("%s: the vm still writes %s after the snapshot", serial, n)
		}
		if info, err := readQCOW2(filepath.Join(dir, n)); err != nil || !strings.HasSuffix(info.Backing, "/"+map[string]string{protocol.StateSerial: StateDiskName, protocol.WorkspaceSerial: WorkspaceDiskName}[serial]) {
			t.Errorf("%s: overlay %s over %q: %v", serial, n, info.Backing, err)
		}
	}
	if e.drv.VM(a.Instance.PID).Paused() {
		t.Error("the vm stayed paused after its snapshot")
	}
	if _, err := e.m.Snapshot(ctx, "a", SnapshotParams{Name: "s1"}); !errors.Is(err, ErrExists) {
		t.Errorf("a second s1: %v", err)
	}
	if _, err := e.m.Snapshot(ctx, "a", SnapshotParams{Name: "../x"}); !errors.Is(err, ErrInvalid) {
		t.Errorf("a bad name: %v", err)
	}

	// Restore: a new QEMU from s1's state, told it was restored.
	r, err := e.m.Restore(ctx, "a", "s1")
	if err != nil {
		t.Fatal(err)
	}
	v := e.drv.VM(r.Instance.PID)
	if r.Instance.PID == a.Instance.PID || !strings.Contains(string(v.From()), "fake vm "+strconv.Itoa(a.Instance.PID)) {
		t.Errorf("restored from %q", v.From()[:min(len(v.From()), 20)])
	}
	if got := v.Restored(); len(got) != 1 || got[0].MachineId != "" || len(got[0].Seed) != 64 {
		t.Errorf("restored guest was told %v", got)
	}
	if r.Origin == nil || r.Origin.Snapshot != "s1" || r.Origin.Session != a.Session || r.Session == a.Session || r.Origin.Fork {
		t.Errorf("restored record %+v", r)
	}

	// Fork: a new VM over the same layers, with its own machine id.
	b, err := e.m.Fork(ctx, "a", "b", "s1")
	if err != nil {
		t.Fatal(err)
	}
	vb := e.drv.VM(b.Instance.PID)
	if got := vb.Restored(); len(got) != 1 || len(got[0].MachineId) != 32 {
		t.Errorf("fork was told %v", got)
	}
	if b.Origin == nil || !b.Origin.Fork || b.Origin.VM != "a" || b.ID == a.ID {
		t.Errorf("fork record %+v", b)
	}
	files, err := chain(filepath.Join(e.reg.Dir("b"), diskName(b, protocol.StateSerial)))
	if err != nil || len(files) < 2 || files[1] != s1.Disks[0].Path && files[1] != s1.Disks[1].Path {
		t.Errorf("fork's state chain %v, %v", files, err)
	}
	if err := e.m.Delete(ctx, "a", true); err == nil || !strings.Contains(err.Error(), "b stand on") {
		t.Errorf("deleting what a fork stands on: %v", err)
	}
	if err := e.m.DeleteSnapshot(ctx, "a", "s1"); err == nil || !strings.Contains(err.Error(), "forked") {
		t.Errorf("deleting a fork's snapshot: %v", err)
	}
	if k := l.kinds(); !strings.Contains(k, "snapshot") {
		t.Errorf("events %s", k)
	}

	// A guest that does not reseed fails its restore; its words are
	// bounded and cleaned in the error.
	e.drv.SetNext(drivertest.Behavior{NotReseeded: "no\x1b[31m" + strings.Repeat("x", 100<<10)})
	if _, err := e.m.Restore(ctx, "a", "s1"); err == nil || !strings.Contains(err.Error(), "could not reseed") || len(err.Error()) > 4096 || strings.Contains(err.Error(), "\x1b") {
		t.Errorf("restore into a guest that does not reseed: %.200v (%d bytes)", err, len(fmt.Sprint(err)))
	}
	if st, _ := e.m.Get("a"); st.State != registry.StateStopped {
		t.Errorf("a vm that could not reseed is %s", st.State)
	}
	if _, err := e.m.Restore(ctx, "a", "s1"); err != nil {
		t.Fatal(err)
	}

	// A damaged state is refused and the VM left as it was.
	before, _ := e.m.Get("a")
	state := filepath.Join(dir, snapshotsDir, "s1", snapshotState)
	os.Chmod(state, 0o600)
	if err := os.WriteFile(state, []byte("not the state"), 0o400); err != nil {
		t.Fatal(err)
	}
	if _, err := e.m.Restore(ctx, "a", "s1"); !errors.Is(err, ErrSnapshotDamaged) {
		t.Errorf("restore of a damaged snapshot: %v", err)
	}
	if after, _ := e.m.Get("a"); after.Instance.PID != before.Instance.PID || after.State != registry.StateRunning {
		t.Errorf("a refused restore changed the vm: %+v", after)
	}

	// A state that cannot be saved: no snapshot, the VM runs on, over
	// whole disks.
	e.drv.SetSnapshotFaults(drivertest.SnapshotFaults{SaveErr: errors.New("no space left on device")})
	if _, err := e.m.Snapshot(ctx, "a", SnapshotParams{Name: "s2"}); err == nil || !strings.Contains(err.Error(), "no space") {
		t.Errorf("snapshot onto a full disk: %v", err)
	}
	snaps, _ := e.m.Snapshots("a")
	if len(snaps) != 1 {
		t.Errorf("snapshots after a failed one: %v", snaps)
	}
	if ents, _ := os.ReadDir(filepath.Join(dir, snapshotsDir)); len(ents) != 1 {
		t.Errorf("left in snapshots/: %v", ents)
	}
	cur, _ := e.m.Get("a")
	if e.drv.VM(cur.Instance.PID).Paused() || cur.PendingDisks != nil {
		t.Errorf("after a failed snapshot: paused %v, pending %v", e.drv.VM(cur.Instance.PID).Paused(), cur.PendingDisks)
	}
	for _, serial := range writableSerials {
		if _, err := readQCOW2(filepath.Join(dir, diskName(cur.Record, serial))); err != nil {
			t.Errorf("%s after a failed snapshot: %v", serial, err)
		}
	}
	// Disks that cannot be frozen: nothing moves.
	e.drv.SetSnapshotFaults(drivertest.SnapshotFaults{FreezeErr: errors.New("qmp: no")})
	if _, err := e.m.Snapshot(ctx, "a", SnapshotParams{Name: "s3"}); err == nil {
		t.Error("a snapshot whose disks could not be frozen succeeded")
	}
	if now, _ := e.m.Get("a"); diskName(now.Record, protocol.StateSerial) != diskName(cur.Record, protocol.StateSerial) || now.PendingDisks != nil {
		t.Errorf("a failed freeze moved the disks: %v, pending %v", now.Disks, now.PendingDisks)
	}
	e.drv.SetSnapshotFaults(drivertest.SnapshotFaults{})

	// Once the fork is gone, its snapshot and the vm may go, and the
	// layers with them.
	if err := e.m.Delete(ctx, "b", true); err != nil {
		t.Fatal(err)
	}
	if err := e.m.DeleteSnapshot(ctx, "a", "s1"); err != nil {
		t.Fatal(err)
	}
	if err := e.m.Delete(ctx, "a", true); err != nil {
		t.Fatal(err)
	}
}

// TestReconcileSettlesAnInterruptedSnapshot: a carreld that died while
// moving a VM to new overlays left them named in pending_disks; the next
// one takes each overlay that QEMU made over the old file, drops the rest,
// and removes the unfinished snapshot's directory.
func TestReconcileSettlesAnInterruptedSnapshot(t *testing.T) {
	// QEMU made the state disk's overlay; the workspace's never came.
	e, a := interruptedFreeze(t, drivertest.SnapshotFaults{}, map[string]string{protocol.StateSerial: "state-0000aaaa.qcow2", protocol.WorkspaceSerial: "workspace-0000bbbb.qcow2"})
	ctx := context.Background()
	dir := e.reg.Dir("a")
	tmp := filepath.Join(dir, snapshotsDir, tmpPrefix+"half")
	if err := os.MkdirAll(tmp, 0o700); err != nil {
		t.Fatal(err)
	}
	e.m = e.manager()
	if err := e.m.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	got, _ := e.m.Get("a")
	if diskName(got.Record, protocol.StateSerial) != "state-0000aaaa.qcow2" || diskName(got.Record, protocol.WorkspaceSerial) != WorkspaceDiskName || got.PendingDisks != nil {
		t.Errorf("settled disks %v, pending %v", got.Disks, got.PendingDisks)
	}
	if _, err := os.Stat(tmp); !os.IsNotExist(err) {
		t.Errorf("the unfinished snapshot is still there: %v", err)
	}
	if got.State != registry.StateRunning || got.Instance.PID != a.Instance.PID {
		t.Errorf("the vm was not adopted as it was: %+v", got)
	}
}

// TestSaveStateIsCapped: a stream over the cap fails the save.
func TestSaveStateIsCapped(t *testing.T) {
	var b bytes.Buffer
	w := driver.LimitWriter(&b, 10)
	if n, err := w.Write(make([]byte, 8)); n != 8 || err != nil {
		t.Fatalf("under the cap: %d %v", n, err)
	}
	if _, err := w.Write(make([]byte, 3)); !errors.Is(err, driver.ErrStateTooLarge) || b.Len() != 8 {
		t.Fatalf("over the cap: %v, %d bytes through", err, b.Len())
	}
	if got := maxStateBytes(256 << 20); got < 256<<20 || got > 512<<20 {
		t.Errorf("cap for 256 MiB: %d", got)
	}
}

// FuzzReadQCOW2: whatever a file holds, the header reader answers without
// panicking, and a backing name it returns lies within its bound.
func FuzzReadQCOW2(f *testing.F) {
	hdr := func(off uint64, n uint32, name string) []byte {
		b := make([]byte, 512)
		copy(b, []byte{0x51, 0x46, 0x49, 0xfb, 0, 0, 0, 3})
		for i := 0; i < 8; i++ {
			b[8+i] = byte(off >> (56 - 8*i))
		}
		for i := 0; i < 4; i++ {
			b[16+i] = byte(n >> (24 - 8*i))
		}
		copy(b[off:], name)
		return b
	}
	f.Add(hdr(104, 9, "/a/b.qcow2"))
	f.Add(hdr(0, 0, ""))
	f.Add(hdr(104, 4000, "x"))
	f.Add([]byte("QFI"))
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, b []byte) {
		p := filepath.Join(dir, "f.qcow2")
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		info, err := readQCOW2(p)
		if err == nil && len(info.Backing) > maxBackingName {
			t.Fatalf("backing name of %d bytes", len(info.Backing))
		}
	})
}

// TestReconcileAsksWhatTheVMHasOpen: a carreld that died after its driver
// made the overlays but before the disks moved to them (the libvirt
// driver makes them first): the VM's driver says it still writes the old
// files, so those stay its disks and the overlays go.
func TestReconcileAsksWhatTheVMHasOpen(t *testing.T) {
	e, _ := interruptedFreeze(t, drivertest.SnapshotFaults{OverlaysOnly: true}, map[string]string{protocol.StateSerial: "state-0000aaaa.qcow2"})
	ctx := context.Background()
	overlay := filepath.Join(e.reg.Dir("a"), "state-0000aaaa.qcow2")
	e.m = e.manager()
	if err := e.m.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	got, _ := e.m.Get("a")
	if diskName(got.Record, protocol.StateSerial) != StateDiskName || got.PendingDisks != nil {
		t.Errorf("settled disks %v, pending %v", got.Disks, got.PendingDisks)
	}
	if _, err := os.Stat(overlay); !os.IsNotExist(err) {
		t.Errorf("the overlay the vm never wrote is still there: %v", err)
	}
}

// interruptedFreeze makes VM "a" and leaves it as a carreld that died
// during a snapshot would: the driver, scripted by faults, froze its state
// disk onto state-0000aaaa.qcow2, and its record names pending as the
// overlays under way. The manager is closed; the caller makes the next.
func interruptedFreeze(t *testing.T, faults drivertest.SnapshotFaults, pending map[string]string) (*env, registry.Record) {
	t.Helper()
	e := newEnv(t)
	e.withSystemImage(t, true)
	ctx := context.Background()
	a, err := e.m.Create(ctx, CreateParams{Name: "a", Image: "sys"})
	if err != nil {
		t.Fatal(err)
	}
	e.m.Close()
	dir := e.reg.Dir("a")
	e.drv.SetSnapshotFaults(faults)
	e.drv.Pause(ctx, *a.Instance)
	if err := e.drv.FreezeDisks(ctx, *a.Instance, map[string]string{filepath.Join(dir, StateDiskName): filepath.Join(dir, "state-0000aaaa.qcow2")}); err != nil {
		t.Fatal(err)
	}
	e.drv.Resume(ctx, *a.Instance)
	r, _ := e.reg.Get("a")
	r.PendingDisks = pending
	if err := e.reg.Put(r); err != nil {
		t.Fatal(err)
	}
	return e, a
}
