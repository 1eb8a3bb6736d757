//go:build linux

package dm

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

var cmdNames = map[uint]string{
	unix.DM_DEV_CREATE:   "create",
	unix.DM_TABLE_LOAD:   "load",
	unix.DM_DEV_SUSPEND:  "resume",
	unix.DM_DEV_REMOVE:   "remove",
	unix.DM_TABLE_STATUS: "status",
}

// fakeKernel answers ioctls like the kernel would for a good table, except
// that fail[cmd] makes that command fail with the given errno.
type fakeKernel struct {
	t      *testing.T
	dev    uint64
	fail   map[string]unix.Errno
	writes bool // resume reply without DM_READONLY_FLAG
	calls  []string
	flags  []uint32
}

func (k *fakeKernel) ioctl(cmd uint, buf []byte) error {
	name := cmdNames[cmd]
	if name == "" {
		k.t.Fatalf("unexpected ioctl %#x", cmd)
	}
	h, err := parseHeader(buf)
	if err != nil {
		k.t.Fatalf("%s: %v", name, err)
	}
	if h.version != [3]uint32{4, 0, 0} || int(h.dataSize) != len(buf) || h.dataStart != headerSize {
		k.t.Errorf("%s: header %+v for a %d-byte buffer", name, h, len(buf))
	}
	k.calls = append(k.calls, name)
	k.flags = append(k.flags, h.flags)
	if e := k.fail[name]; e != 0 {
		return e
	}
	switch name {
	case "create":
		ne.PutUint64(buf[offDev:], k.dev)
	case "resume":
		flags := uint32(unix.DM_ACTIVE_PRESENT_FLAG)
		if !k.writes {
			flags |= unix.DM_READONLY_FLAG
		}
		ne.PutUint32(buf[offFlags:], flags)
	}
	return nil
}

func TestCreateReadOnlySteps(t *testing.T) {
	tgt := Target{Length: 2048, Type: "verity", Params: "1 /dev/vda /dev/vda 4096 4096 256 1 sha256 00 -"}
	dev := unix.Mkdev(252, 3)
	nodeErr := errors.New("no node")
	for _, c := range []struct {
		desc    string
		fail    map[string]unix.Errno
		writes  bool
		nodeErr error
		calls   string
		errText string
		errno   unix.Errno
	}{
		{desc: "ok", calls: "create load resume"},
		{desc: "name taken", fail: map[string]unix.Errno{"create": unix.EBUSY},
			calls: "create", errText: `dm: create "root": device or resource busy`, errno: unix.EBUSY},
		{desc: "bad table", fail: map[string]unix.Errno{"load": unix.EINVAL},
			calls: "create load remove", errText: `dm: load table for "root": invalid argument`, errno: unix.EINVAL},
		{desc: "resume fails", fail: map[string]unix.Errno{"resume": unix.EIO},
			calls: "create load resume remove", errText: `dm: resume "root": input/output error`, errno: unix.EIO},
		{desc: "not read-only", writes: true,
			calls: "create load resume remove", errText: "did not make the device read-only"},
		{desc: "node fails", nodeErr: nodeErr,
			calls: "create load resume remove", errText: `dm: device node for "root": no node`},
		{desc: "remove fails too", fail: map[string]unix.Errno{"load": unix.EINVAL, "remove": unix.EBUSY},
			calls: "create load remove", errText: `dm: remove "root": device or resource busy`, errno: unix.EINVAL},
	} {
		k := &fakeKernel{t: t, dev: dev, fail: c.fail, writes: c.writes}
		var nodeDev uint64
		s := system{ioctl: k.ioctl, node: func(d uint64) (string, error) {
			nodeDev = d
			return "/dev/dm-3", c.nodeErr
		}}
		gotDev, path, err := s.createReadOnly("root", tgt)
		if got := strings.Join(k.calls, " "); got != c.calls {
			t.Errorf("%s: calls %q, want %q", c.desc, got, c.calls)
		}
		if c.errText == "" {
			if err != nil || gotDev != dev || path != "/dev/dm-3" || nodeDev != dev {
				t.Errorf("%s: %#x %q %v (node asked for %#x)", c.desc, gotDev, path, err, nodeDev)
			}
			// Load is read-only; create and resume carry no flags, so
			// the resume is not a suspend.
			want := []uint32{0, unix.DM_READONLY_FLAG, 0}
			for i := range want {
				if k.flags[i] != want[i] {
					t.Errorf("%s: %s flags %#x, want %#x", c.desc, k.calls[i], k.flags[i], want[i])
				}
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), c.errText) {
			t.Errorf("%s: error %v, want it to contain %q", c.desc, err, c.errText)
		}
		if c.errno != 0 && !errors.Is(err, c.errno) {
			t.Errorf("%s: error %v does not wrap %v", c.desc, err, c.errno)
		}
		if gotDev != 0 || path != "" {
			t.Errorf("%s: returned %#x %q with an error", c.desc, gotDev, path)
		}
	}
}

func TestCreateReadOnlyValidatesFirst(t *testing.T) {
	// These fail before any file is opened, so they need no privileges.
	if _, _, err := CreateReadOnly(strings.Repeat("x", 128), Target{Length: 1, Type: "error"}); err == nil {
		t.Error("128-byte name accepted")
	}
	if _, _, err := CreateReadOnly("root", Target{Length: 1, Type: "sixteen-bytes-xx"}); err == nil {
		t.Error("16-byte target type accepted")
	}
	if err := Remove("a/b"); err == nil {
		t.Error("Remove accepted a name with '/'")
	}
	if _, err := Status(""); err == nil {
		t.Error("Status accepted an empty name")
	}
}

func TestStatusGrowsBuffer(t *testing.T) {
	var sizes []int
	ioctl := func(cmd uint, buf []byte) error {
		if cmd != unix.DM_TABLE_STATUS {
			t.Fatalf("cmd %#x", cmd)
		}
		if f := ne.Uint32(buf[offFlags:]); f&unix.DM_STATUS_TABLE_FLAG != 0 {
			t.Errorf("flags %#x ask for the table, not the status", f)
		}
		sizes = append(sizes, len(buf))
		if len(buf) < 4*statusBufSize {
			ne.PutUint32(buf[offFlags:], unix.DM_BUFFER_FULL_FLAG)
			return nil
		}
		copy(buf, statusReply(len(buf), targetStatus{Length: 8, Type: "verity", Status: "C -"}))
		return nil
	}
	got, err := status(ioctl, "root")
	if err != nil || got != "C -" {
		t.Fatalf("status %q, %v", got, err)
	}
	if want := []int{statusBufSize, 2 * statusBufSize, 4 * statusBufSize}; len(sizes) != 3 ||
		sizes[0] != want[0] || sizes[1] != want[1] || sizes[2] != want[2] {
		t.Errorf("buffer sizes %v, want %v", sizes, want)
	}
}

func TestStatusErrors(t *testing.T) {
	alwaysFull := func(cmd uint, buf []byte) error {
		ne.PutUint32(buf[offFlags:], unix.DM_BUFFER_FULL_FLAG)
		return nil
	}
	if _, err := status(alwaysFull, "root"); err == nil || !strings.Contains(err.Error(), "does not fit") {
		t.Errorf("always full: %v", err)
	}
	noDev := func(cmd uint, buf []byte) error { return unix.ENXIO }
	if _, err := status(noDev, "root"); !errors.Is(err, unix.ENXIO) || err.Error() != `dm: status of "root": no such device or address` {
		t.Errorf("no device: %v", err)
	}
	noTable := func(cmd uint, buf []byte) error { copy(buf, statusReply(len(buf))); return nil }
	if _, err := status(noTable, "root"); err == nil || !strings.Contains(err.Error(), "0 targets") {
		t.Errorf("no table: %v", err)
	}
	two := func(cmd uint, buf []byte) error {
		copy(buf, statusReply(len(buf), targetStatus{Length: 1, Type: "error"}, targetStatus{Start: 1, Length: 1, Type: "error"}))
		return nil
	}
	if _, err := status(two, "root"); err == nil || !strings.Contains(err.Error(), "2 targets") {
		t.Errorf("two targets: %v", err)
	}
}

func TestEnsureNodeRefusesOtherFiles(t *testing.T) {
	dir := t.TempDir()
	dev := unix.Mkdev(252, 7)
	if err := os.WriteFile(filepath.Join(dir, "dm-7"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := ensureNode(dir, dev, 0); err == nil || !strings.Contains(err.Error(), "not block device 252:7") {
		t.Errorf("regular file: %v", err)
	}
}

func TestEnsureNodeMakesNode(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to make a device node")
	}
	dir := t.TempDir()
	dev := unix.Mkdev(252, 1<<12|5) // a minor above 255 tests the dev_t encoding
	path, err := ensureNode(dir, dev, 0)
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(dir, "dm-4101"); path != want {
		t.Errorf("path %q, want %q", path, want)
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK || uint64(st.Rdev) != dev {
		t.Errorf("mode %#o rdev %#x, want block %#x", st.Mode, st.Rdev, dev)
	}
	// A second call finds the node it made.
	if again, err := ensureNode(dir, dev, 0); err != nil || again != path {
		t.Errorf("second call: %q, %v", again, err)
	}
}

func TestParseMajorMinor(t *testing.T) {
	if ma, mi, ok := parseMajorMinor("10:236\n"); !ok || ma != 10 || mi != 236 {
		t.Errorf("got %d:%d %v", ma, mi, ok)
	}
	for _, s := range []string{"", "10", "10:", ":236", "a:b", "10:236:1", "-1:2"} {
		if _, _, ok := parseMajorMinor(s); ok {
			t.Errorf("%q parsed", s)
		}
	}
}
