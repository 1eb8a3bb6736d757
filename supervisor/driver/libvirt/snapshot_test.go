package libvirt

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	lv "github.com/digitalocean/go-libvirt"

	"github.com/carrel-os/carrel/supervisor/driver"
)

// qemuImg runs qemu-img, failing the test on error.
func qemuImg(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command("qemu-img", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("qemu-img %v: %v: %s", args, err, out)
	}
	return string(out)
}

// withDisk gives spec a writable qcow2 disk over a raw file, as carreld's
// VMs have, and returns the disk.
func (e *env) withDisk(spec *driver.Spec) driver.Disk {
	e.t.Helper()
	base := filepath.Join(spec.Dir, "base.raw")
	if err := os.WriteFile(base, make([]byte, 1<<20), 0o400); err != nil {
		e.t.Fatal(err)
	}
	disk := driver.Disk{Path: filepath.Join(spec.Dir, "state.qcow2"), Format: driver.FormatQCOW2, Backing: base, Serial: "carrel-state"}
	qemuImg(e.t, "create", "-q", "-f", "qcow2", "-F", "raw", "-b", base, disk.Path, "1M")
	spec.Disks = append(spec.Disks, disk)
	return disk
}

// liveDisk is the file the domain's one disk has open now.
func (e *env) liveDisk(inst driver.Instance) string {
	e.t.Helper()
	dom, err := e.d.instDomain(context.Background(), inst)
	if err != nil {
		e.t.Fatal(err)
	}
	live, err := e.d.liveDomain(context.Background(), dom)
	if err != nil {
		e.t.Fatal(err)
	}
	return live.Devices.Disks[0].Source.File.File
}

// TestSnapshotOnLibvirtd runs the driver's snapshot calls against the
// real libvirtd: a disk moves to a new overlay and its file stays as it
// was; the memory is saved as a libvirt save image, within a bound; a new
// VM (a fork, another name and UUID) starts from it while its parent
// runs; the parent itself is restored from it; and a damaged state is
// refused with nothing left behind.
func TestSnapshotOnLibvirtd(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	spec := e.spec(haltKernel)
	disk := e.withDisk(&spec)
	inst, err := e.d.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.d.Resume(ctx, inst); err != nil {
		t.Fatal(err)
	}
	if err := e.d.Pause(ctx, inst); err != nil {
		t.Fatal(err)
	}

	// The disk moves to an overlay over its file; libvirt reuses the
	// overlay the driver made, which QEMU, as its own user, can open.
	overlay := filepath.Join(spec.Dir, "state-1.qcow2")
	if err := e.d.FreezeDisks(ctx, inst, map[string]string{disk.Path: overlay}); err != nil {
		t.Fatal(err)
	}
	if got := e.liveDisk(inst); got != overlay {
		t.Errorf("after the freeze the domain writes %s, want %s", got, overlay)
	}
	if info := qemuImg(t, "info", "-U", overlay); !strings.Contains(info, "backing file: "+disk.Path) {
		t.Errorf("overlay:\n%s", info)
	}
	// A disk the domain does not have open fails, and moves nothing.
	if err := e.d.FreezeDisks(ctx, inst, map[string]string{"/nonexistent.qcow2": filepath.Join(spec.Dir, "x.qcow2")}); err == nil {
		t.Error("froze a disk the domain does not have")
	}
	if _, err := os.Stat(filepath.Join(spec.Dir, "x.qcow2")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a refused freeze left its overlay: %v", err)
	}

	// Over its bound, the state is refused and removed.
	small := filepath.Join(spec.Dir, "small.state")
	if _, err := e.d.SaveState(ctx, inst, small, 4096); !errors.Is(err, driver.ErrStateTooLarge) {
		t.Errorf("a state over its bound: %v", err)
	}
	if _, err := os.Stat(small); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the refused state is still there: %v", err)
	}
	if err := e.d.Resume(ctx, inst); err != nil {
		t.Fatal(err)
	}
	if err := e.d.Pause(ctx, inst); err != nil {
		t.Fatal(err)
	}
	state := filepath.Join(spec.Dir, "state")
	n, err := e.d.SaveState(ctx, inst, state, 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(state); err != nil || fi.Size() != n || n < 64<<10 {
		t.Fatalf("saved state: %d bytes said, %v %v", n, fi, err)
	}
	if err := e.d.Resume(ctx, inst); err != nil {
		t.Fatal(err)
	}
	if st := e.state(inst.Domain); st != lv.DomainRunning {
		t.Fatalf("after the save the parent is in state %d", st)
	}

	// A fork: another VM over the frozen file, started from the state
	// while the parent runs.
	fork := e.spec(haltKernel)
	forkDisk := driver.Disk{Path: filepath.Join(fork.Dir, "state.qcow2"), Format: driver.FormatQCOW2, Backing: disk.Backing, Layers: []string{disk.Path}, Serial: disk.Serial}
	qemuImg(t, "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", disk.Path, forkDisk.Path, "1M")
	fork.Disks = []driver.Disk{forkDisk}
	f, err := os.Open(state)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fork.Incoming = f
	finst, err := e.d.Start(ctx, fork)
	if err != nil {
		t.Fatal(err)
	}
	if finst.DomainUUID == inst.DomainUUID || finst.Domain == inst.Domain || finst.PID == 0 || finst.DataSocket != filepath.Join(fork.Dir, dataSocketName) {
		t.Errorf("fork instance %+v, parent %+v", finst, inst)
	}
	if paused, err := e.d.Adopt(ctx, finst); err != nil || !paused {
		t.Errorf("fork after start: paused %v, %v", paused, err)
	}
	if got := e.liveDisk(finst); got != forkDisk.Path {
		t.Errorf("the fork writes %s, want %s", got, forkDisk.Path)
	}
	if _, err := os.Stat(filepath.Join(fork.Dir, incomingName)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the image written for libvirt is still there: %v", err)
	}
	if err := e.d.Resume(ctx, finst); err != nil {
		t.Fatal(err)
	}
	if a, b := e.state(inst.Domain), e.state(finst.Domain); a != lv.DomainRunning || b != lv.DomainRunning {
		t.Errorf("parent and fork: states %d and %d", a, b)
	}
	if err := e.d.Kill(ctx, finst); err != nil {
		t.Fatal(err)
	}

	// The parent restored from the state, over a new overlay.
	if err := e.d.Kill(ctx, inst); err != nil {
		t.Fatal(err)
	}
	again := disk
	again.Path, again.Layers = filepath.Join(spec.Dir, "state-2.qcow2"), []string{disk.Path}
	qemuImg(t, "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", disk.Path, again.Path, "1M")
	spec.Disks, spec.Incoming = []driver.Disk{again}, f
	rinst, err := e.d.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if rinst.DomainUUID == inst.DomainUUID {
		t.Error("the restored domain kept the old uuid")
	}
	if err := e.d.Resume(ctx, rinst); err != nil {
		t.Fatal(err)
	}
	if st := e.state(rinst.Domain); st != lv.DomainRunning {
		t.Errorf("restored: state %d", st)
	}
	if err := e.d.Kill(ctx, rinst); err != nil {
		t.Fatal(err)
	}

	// A damaged state: a clear error, and no domain.
	bad := filepath.Join(spec.Dir, "bad")
	b, _ := os.ReadFile(state)
	b[3] ^= 0xff
	if err := os.WriteFile(bad, b, 0o600); err != nil {
		t.Fatal(err)
	}
	g, err := os.Open(bad)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	spec.Incoming = g
	if _, err := e.d.Start(ctx, spec); err == nil || !strings.Contains(err.Error(), "not a complete libvirt save image") {
		t.Errorf("start from a damaged state: %v", err)
	}
	if st := e.state(DomainName(spec.Name)); st != -1 {
		t.Errorf("a refused start left a domain in state %d", st)
	}
}

// TestRestoreWithoutDataPortOnLibvirtd: a state saved from a domain
// without the data port (carrel's domains before it existed) restores,
// paused, into a domain without one, whatever the spec says, and the
// instance says so.
func TestRestoreWithoutDataPortOnLibvirtd(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	spec := e.spec(haltKernel)
	spec.NoDataPort = true
	inst, err := e.d.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if inst.DataSocket != "" {
		t.Errorf("a domain without a data port has data socket %q", inst.DataSocket)
	}
	state := filepath.Join(spec.Dir, "state")
	if _, err := e.d.SaveState(ctx, inst, state, 1<<30); err != nil {
		t.Fatal(err)
	}
	if err := e.d.Kill(ctx, inst); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(state)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	spec.NoDataPort, spec.Incoming = false, f
	rinst, err := e.d.Start(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if rinst.DataSocket != "" {
		t.Errorf("restored without a data port, the instance has data socket %q", rinst.DataSocket)
	}
	dom, err := e.d.instDomain(ctx, rinst)
	if err != nil {
		t.Fatal(err)
	}
	live, err := e.d.liveDomain(ctx, dom)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(live.Devices.Channels); n != 1 {
		t.Errorf("restored domain has %d channels, want the agent's alone", n)
	}
	if err := e.d.Resume(ctx, rinst); err != nil {
		t.Fatal(err)
	}
	if st := e.state(rinst.Domain); st != lv.DomainRunning {
		t.Errorf("restored: state %d", st)
	}
}
