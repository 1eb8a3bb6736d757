package libvirt

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"time"

	lv "github.com/digitalocean/go-libvirt"
	"libvirt.org/go/libvirtxml"

	"github.com/carrel-os/carrel/image/workspace"
	"github.com/carrel-os/carrel/supervisor/driver"
)

var _ driver.Snapshotter = (*Driver)(nil)

// incomingName is the save image a restore writes for libvirt to read.
const incomingName = "incoming.img"

// FreezeDisks implements driver.Snapshotter with an external, disk-only
// snapshot that libvirt keeps no metadata of. libvirt would make each
// overlay as root, where QEMU, running as its own user with relabel='no',
// could not open it; so the driver makes them itself, over the files the
// disks have open, grants QEMU's user access as at Start, and has libvirt
// reuse them. All disks move or none (libvirt's atomic snapshot).
func (d *Driver) FreezeDisks(ctx context.Context, inst driver.Instance, overlays map[string]string) (err error) {
	dom, _, err := d.activeDomain(ctx, inst)
	if err != nil {
		return err
	}
	live, err := d.liveDomain(ctx, dom)
	if err != nil {
		return err
	}
	uid, _, err := d.qemuUser(ctx)
	if err != nil {
		return err
	}
	snap := libvirtxml.DomainSnapshot{Disks: &libvirtxml.DomainSnapshotDisks{}}
	var made []string
	defer func() {
		if err != nil {
			for _, p := range made {
				_ = os.Remove(p)
			}
		}
	}()
	found := 0
	for _, disk := range live.Devices.Disks {
		if disk.Target == nil {
			continue
		}
		dev := disk.Target.Dev
		var cur string
		if disk.Source != nil && disk.Source.File != nil {
			cur = disk.Source.File.File
		}
		next, ok := overlays[cur]
		if !ok || cur == "" {
			snap.Disks.Disks = append(snap.Disks.Disks, libvirtxml.DomainSnapshotDisk{Name: dev, Snapshot: "no"})
			continue
		}
		found++
		var capacity uint64
		err = d.do(ctx, "read disk "+dev+" of domain "+dom.Name, func(c *lv.Libvirt) (err error) {
			_, capacity, _, err = c.DomainGetBlockInfo(dom, dev, 0)
			return err
		})
		if err != nil {
			return err
		}
		if err = workspace.Overlay(ctx, d.cfg.QEMUImg, next, cur, capacity); err != nil {
			return err
		}
		made = append(made, next)
		if _, err = grantReadWrite(next, uid); err != nil {
			return fmt.Errorf("let qemu (uid %d) write %s: %w", uid, next, err)
		}
		snap.Disks.Disks = append(snap.Disks.Disks, libvirtxml.DomainSnapshotDisk{
			Name: dev, Snapshot: "external",
			Driver: &libvirtxml.DomainDiskDriver{Type: driver.FormatQCOW2},
			Source: &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: next}},
		})
	}
	if found != len(overlays) {
		err = fmt.Errorf("domain %s has %d of the %d disks to freeze open", dom.Name, found, len(overlays))
		return err
	}
	if found == 0 {
		return nil
	}
	x, err := snap.Marshal()
	if err != nil {
		return err
	}
	flags := lv.DomainSnapshotCreateDiskOnly | lv.DomainSnapshotCreateReuseExt | lv.DomainSnapshotCreateNoMetadata | lv.DomainSnapshotCreateAtomic
	err = d.do(ctx, "snapshot the disks of domain "+dom.Name, func(c *lv.Libvirt) error {
		_, err := c.DomainSnapshotCreateXML(dom, x, uint32(flags))
		return err
	})
	if err == nil {
		return nil
	}
	// A call cut short may have gone through all the same: what the disks
	// have open says.
	qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rpcTimeout)
	defer cancel()
	files, qerr := d.OpenDiskFiles(qctx, inst)
	if qerr != nil {
		made = nil // QEMU may be writing them
		return fmt.Errorf("%w: %w (asking libvirt since: %v)", driver.ErrDisksUnknown, err, qerr)
	}
	moved := 0
	for _, p := range made {
		if slices.Contains(files, p) {
			moved++
		}
	}
	switch moved {
	case 0:
		return err
	case len(made):
		d.log.Warn("the disk snapshot went through though its call failed", "domain", dom.Name, "err", err)
		made = nil
		return nil
	default:
		n := len(made)
		made = nil
		return fmt.Errorf("%w: %w (%d of %d disks moved)", driver.ErrDisksUnknown, err, moved, n)
	}
}

// SaveState implements driver.Snapshotter with an external snapshot of
// the memory alone, which libvirt writes at path as a save image (see
// saveimage.go) and keeps no metadata of. libvirt, not carreld, writes
// the file, so max is checked once it is written. After it the domain is
// paused; Resume continues it.
func (d *Driver) SaveState(ctx context.Context, inst driver.Instance, path string, max int64) (int64, error) {
	dom, _, err := d.activeDomain(ctx, inst)
	if err != nil {
		return 0, err
	}
	live, err := d.liveDomain(ctx, dom)
	if err != nil {
		return 0, err
	}
	if _, err := os.Lstat(path); err == nil {
		return 0, fmt.Errorf("save vm state: %s: %w", path, os.ErrExist)
	}
	snap := libvirtxml.DomainSnapshot{
		Memory: &libvirtxml.DomainSnapshotMemory{Snapshot: "external", File: path},
		Disks:  &libvirtxml.DomainSnapshotDisks{},
	}
	for _, disk := range live.Devices.Disks {
		if disk.Target != nil {
			snap.Disks.Disks = append(snap.Disks.Disks, libvirtxml.DomainSnapshotDisk{Name: disk.Target.Dev, Snapshot: "no"})
		}
	}
	x, err := snap.Marshal()
	if err != nil {
		return 0, err
	}
	err = d.doLong(ctx, "save the memory of domain "+dom.Name, func(c *lv.Libvirt) error {
		_, err := c.DomainSnapshotCreateXML(dom, x, uint32(lv.DomainSnapshotCreateNoMetadata))
		return err
	})
	if err != nil {
		if ctx.Err() != nil {
			// libvirtd goes on saving: stop it, or the domain stays busy
			// and cannot be resumed.
			err = errors.Join(err, d.abortJob(context.WithoutCancel(ctx), dom))
		}
		_ = os.Remove(path)
		return 0, fmt.Errorf("save vm state: %w", err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		return 0, fmt.Errorf("save vm state: %w", err)
	}
	if fi.Size() > max {
		_ = os.Remove(path)
		return 0, fmt.Errorf("save vm state: %d bytes: %w", fi.Size(), driver.ErrStateTooLarge)
	}
	return fi.Size(), nil
}

var _ driver.DiskFiles = (*Driver)(nil)

// OpenDiskFiles implements driver.DiskFiles from the domain's live XML:
// FreezeDisks makes the overlays before libvirt moves the disks to them.
func (d *Driver) OpenDiskFiles(ctx context.Context, inst driver.Instance) ([]string, error) {
	dom, _, err := d.activeDomain(ctx, inst)
	if err != nil {
		return nil, err
	}
	live, err := d.liveDomain(ctx, dom)
	if err != nil {
		return nil, err
	}
	var files []string
	for _, disk := range live.Devices.Disks {
		if disk.Source != nil && disk.Source.File != nil {
			files = append(files, disk.Source.File.File)
		}
	}
	return files, nil
}

// abortJob aborts dom's job and waits, up to rpcTimeout, until it has
// ended.
func (d *Driver) abortJob(ctx context.Context, dom lv.Domain) error {
	ctx, cancel := context.WithTimeout(ctx, rpcTimeout)
	defer cancel()
	if err := d.do(ctx, "abort the job of domain "+dom.Name, func(c *lv.Libvirt) error { return c.DomainAbortJob(dom) }); err != nil {
		return err
	}
	for {
		var typ int32
		err := d.do(ctx, "read the job of domain "+dom.Name, func(c *lv.Libvirt) (err error) {
			typ, _, _, _, _, _, _, _, _, _, _, _, err = c.DomainGetJobInfo(dom)
			return err
		})
		if err != nil || typ == int32(lv.DomainJobNone) {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the aborted job of domain %s has not ended: %w", dom.Name, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// liveDomain reads dom's XML as it runs.
func (d *Driver) liveDomain(ctx context.Context, dom lv.Domain) (*libvirtxml.Domain, error) {
	var x string
	err := d.do(ctx, "read domain "+dom.Name, func(c *lv.Libvirt) (err error) {
		x, err = c.DomainGetXMLDesc(dom, 0)
		return err
	})
	if err != nil {
		return nil, err
	}
	var live libvirtxml.Domain
	if err := live.Unmarshal(x); err != nil {
		return nil, fmt.Errorf("parse domain %s: %w", dom.Name, err)
	}
	if live.Devices == nil {
		return nil, fmt.Errorf("domain %s has no devices", dom.Name)
	}
	return &live, nil
}

// restore creates the domain of c, paused, from the save image
// c.Spec.Incoming: it writes the image again for c's name and UUID (see
// saveimage.go) in the VM's directory, has libvirt restore it, and
// removes it. data says whether the domain has a data port, as the saved
// one had.
func (d *Driver) restore(ctx context.Context, c domainConfig, l layout) (dom lv.Domain, data bool, err error) {
	// A description of its own, so the caller's file offset stays.
	in, err := os.Open("/proc/self/fd/" + strconv.Itoa(int(c.Spec.Incoming.Fd())))
	if err != nil {
		return lv.Domain{}, false, fmt.Errorf("open the saved state: %w", err)
	}
	defer in.Close()
	img, err := readSaveImage(in)
	if err != nil {
		return lv.Domain{}, false, fmt.Errorf("the saved state: %w", err)
	}
	headerXML, full, data, err := restoreXML(img.XML, c)
	if err != nil {
		return lv.Domain{}, false, fmt.Errorf("the saved state: %w", err)
	}
	hdr, err := img.header(headerXML)
	if err != nil {
		return lv.Domain{}, false, err
	}
	path := filepath.Join(l.dir, incomingName)
	_ = os.Remove(path)
	defer os.Remove(path)
	if err := writeImage(path, hdr, in, img.Stream); err != nil {
		return lv.Domain{}, false, fmt.Errorf("write the state for libvirt: %w", err)
	}
	u, err := parseUUID(c.UUID)
	if err != nil {
		return lv.Domain{}, false, err
	}
	err = d.doLong(ctx, "restore domain "+c.Name, func(lc *lv.Libvirt) error {
		if err := lc.DomainRestoreFlags(path, lv.OptString{full}, uint32(lv.DomainSavePaused)); err != nil {
			return err
		}
		var err error
		dom, err = lc.DomainLookupByUUID(u)
		return err
	})
	return dom, data, err
}

// writeImage writes hdr, then what in holds from offset on, to a new file
// at path, readable by root alone (libvirtd reads it as root).
func writeImage(path string, hdr []byte, in *os.File, offset int64) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := f.Write(hdr); err != nil {
		return err
	}
	if _, err := in.Seek(offset, 0); err != nil {
		return err
	}
	// *os.File to *os.File: the kernel copies (copy_file_range).
	if _, err := f.ReadFrom(in); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return errors.Join(err, os.Remove(path))
	}
	return nil
}
