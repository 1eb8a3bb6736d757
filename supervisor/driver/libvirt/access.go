package libvirt

import (
	"encoding/binary"
	"errors"
	"fmt"
	"path/filepath"
	"sort"

	"golang.org/x/sys/unix"
)

// Under libvirt, QEMU runs as an unprivileged user (libvirt-qemu on
// Debian) and opens the kernel and initrd itself, but carreld's state
// directory is root's, mode 0700. grantRead (and grantReadWrite, for the
// workspace disk) gives that one user what it needs through POSIX ACLs, as virt-manager does for images outside
// libvirt's directories: search (x) on each directory above the file and
// read on the file. It changes no owner and no mode bits, and grants
// nothing to anyone else: the user can reach only the paths it is given,
// not list the directories on the way.

// POSIX ACL xattr format (linux/posix_acl_xattr.h).
const (
	aclXattr    = "system.posix_acl_access"
	aclVersion  = 2
	aclUserObj  = 0x01
	aclUser     = 0x02
	aclGroupObj = 0x04
	aclGroup    = 0x08
	aclMask     = 0x10
	aclOther    = 0x20
	aclNoID     = 0xffffffff

	permRead   = 4
	permWrite  = 2
	permSearch = 1
)

type aclEntry struct {
	tag  uint16
	perm uint16
	id   uint32
}

// grantRead lets uid read path. It returns the paths whose ACL it changed.
func grantRead(path string, uid int) ([]string, error) {
	return grantAccess(path, uid, permRead)
}

// grantReadWrite lets uid read and write path (a VM's workspace disk).
func grantReadWrite(path string, uid int) ([]string, error) {
	return grantAccess(path, uid, permRead|permWrite)
}

// grantAccess gives uid perm on path, and search on the directories above
// it. It returns the paths whose ACL it changed.
func grantAccess(path string, uid int, perm uint16) ([]string, error) {
	if uid == 0 {
		return nil, nil
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, err
	}
	var dirs []string
	for d := filepath.Dir(abs); ; d = filepath.Dir(d) {
		dirs = append(dirs, d)
		if d == "/" {
			break
		}
	}
	var changed []string
	for i := len(dirs) - 1; i >= 0; i-- {
		ok, err := grant(dirs[i], uint32(uid), permSearch)
		if err != nil {
			return changed, err
		}
		if ok {
			changed = append(changed, dirs[i])
		}
	}
	ok, err := grant(abs, uint32(uid), perm)
	if ok {
		changed = append(changed, abs)
	}
	return changed, err
}

// grant makes sure uid has perm on path, adding an ACL entry if the mode
// bits do not already give it. It reports whether it changed the ACL.
func grant(path string, uid uint32, perm uint16) (bool, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return false, fmt.Errorf("stat %s: %w", path, err)
	}
	mode := uint16(st.Mode & 0o777)
	if mode&perm == perm {
		return false, nil // everyone has it
	}
	if st.Uid == uid {
		if (mode>>6)&perm == perm {
			return false, nil
		}
		return false, fmt.Errorf("%s is owned by uid %d but not accessible to it (mode %o)", path, uid, mode)
	}
	acl, err := readACL(path, mode)
	if err != nil {
		return false, err
	}
	if hasPerm(acl, uid, perm) {
		return false, nil
	}
	acl = addUserPerm(acl, uid, perm)
	if err := unix.Setxattr(path, aclXattr, encodeACL(acl), 0); err != nil {
		if errors.Is(err, unix.EOPNOTSUPP) {
			return false, fmt.Errorf("grant uid %d access to %s: the file system has no POSIX ACLs: make it readable (or searchable, for a directory) by that user: %w", uid, path, err)
		}
		return false, fmt.Errorf("grant uid %d access to %s: %w", uid, path, err)
	}
	return true, nil
}

// readACL returns path's access ACL, or the minimal one its mode implies.
func readACL(path string, mode uint16) ([]aclEntry, error) {
	buf := make([]byte, 4+8*32)
	for {
		n, err := unix.Getxattr(path, aclXattr, buf)
		switch {
		case errors.Is(err, unix.ENODATA), errors.Is(err, unix.EOPNOTSUPP):
			return []aclEntry{
				{aclUserObj, (mode >> 6) & 7, aclNoID},
				{aclGroupObj, (mode >> 3) & 7, aclNoID},
				{aclOther, mode & 7, aclNoID},
			}, nil
		case errors.Is(err, unix.ERANGE):
			buf = make([]byte, 2*len(buf))
			continue
		case err != nil:
			return nil, fmt.Errorf("read acl of %s: %w", path, err)
		}
		return decodeACL(buf[:n])
	}
}

func decodeACL(b []byte) ([]aclEntry, error) {
	if len(b) < 4 || (len(b)-4)%8 != 0 || binary.LittleEndian.Uint32(b) != aclVersion {
		return nil, fmt.Errorf("malformed acl xattr (%d bytes)", len(b))
	}
	var acl []aclEntry
	for p := b[4:]; len(p) > 0; p = p[8:] {
		acl = append(acl, aclEntry{
			tag:  binary.LittleEndian.Uint16(p),
			perm: binary.LittleEndian.Uint16(p[2:]),
			id:   binary.LittleEndian.Uint32(p[4:]),
		})
	}
	return acl, nil
}

func encodeACL(acl []aclEntry) []byte {
	b := binary.LittleEndian.AppendUint32(nil, aclVersion)
	for _, e := range acl {
		b = binary.LittleEndian.AppendUint16(b, e.tag)
		b = binary.LittleEndian.AppendUint16(b, e.perm)
		b = binary.LittleEndian.AppendUint32(b, e.id)
	}
	return b
}

// hasPerm reports whether the ACL gives uid perm through a user entry
// that the mask lets through.
func hasPerm(acl []aclEntry, uid uint32, perm uint16) bool {
	mask, user := uint16(7), uint16(0)
	for _, e := range acl {
		switch {
		case e.tag == aclMask:
			mask = e.perm
		case e.tag == aclUser && e.id == uid:
			user = e.perm
		}
	}
	return user&mask&perm == perm
}

// addUserPerm adds perm to uid's entry (creating it) and recomputes the
// mask as the union of the group class, as setfacl does. The entries stay
// in the order the kernel requires: by tag, then by id.
func addUserPerm(acl []aclEntry, uid uint32, perm uint16) []aclEntry {
	var out []aclEntry
	found := false
	for _, e := range acl {
		if e.tag == aclMask {
			continue
		}
		if e.tag == aclUser && e.id == uid {
			e.perm |= perm
			found = true
		}
		out = append(out, e)
	}
	if !found {
		out = append(out, aclEntry{aclUser, perm, uid})
	}
	var mask uint16
	for _, e := range out {
		if e.tag == aclUser || e.tag == aclGroupObj || e.tag == aclGroup {
			mask |= e.perm
		}
	}
	out = append(out, aclEntry{aclMask, mask, aclNoID})
	sort.SliceStable(out, func(i, j int) bool {
		if out[i].tag != out[j].tag {
			return out[i].tag < out[j].tag
		}
		return out[i].id < out[j].id
	})
	return out
}
