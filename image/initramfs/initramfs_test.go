package initramfs

import (
	"bytes"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
)

// sample returns a source file and an archive with one of each kind of entry.
func sample(t *testing.T, reverse bool) *Archive {
	t.Helper()
	src := filepath.Join(t.TempDir(), "agent")
	if err := os.WriteFile(src, []byte("#!agent binary"), 0o600); err != nil {
		t.Fatal(err)
	}
	adds := []func(a *Archive) error{
		func(a *Archive) error { return a.FileFrom("init", 0o755, src) },
		func(a *Archive) error { return a.File("etc/hostname", 0o644, []byte("carrel\n")) },
		func(a *Archive) error { return a.File("etc/empty", 0o644, nil) },
		func(a *Archive) error { return a.Dir("tmp", 0o777|fs.ModeSticky) },
		func(a *Archive) error { return a.Dir("proc", 0o555) },
		func(a *Archive) error {
			return a.Add(Entry{Name: "home/agent", Mode: fs.ModeDir | 0o700, UID: 1000, GID: 1000})
		},
		func(a *Archive) error { return a.Symlink("usr/bin/head", "/bin/busybox") },
		func(a *Archive) error { return a.Symlink("bin/sh", "busybox") },
		func(a *Archive) error { return a.File("bin/busybox", 0o755, []byte("bb")) },
		func(a *Archive) error { return a.CharDev("dev/console", 0o600, 5, 1) },
		func(a *Archive) error { return a.File("/lib/modules/x/a-b.ko", 0o644, []byte("odd")) },
		func(a *Archive) error { return a.Dir("lib", 0o700) },
	}
	if reverse {
		sort.SliceStable(adds, func(i, j int) bool { return i > j })
	}
	a := New()
	for _, add := range adds {
		if err := add(a); err != nil {
			t.Fatal(err)
		}
	}
	return a
}

func write(t *testing.T, a *Archive) []byte {
	t.Helper()
	var b bytes.Buffer
	n, err := a.WriteTo(&b)
	if err != nil {
		t.Fatal(err)
	}
	if n != int64(b.Len()) {
		t.Fatalf("WriteTo returned %d, wrote %d", n, b.Len())
	}
	return b.Bytes()
}

func TestDeterministic(t *testing.T) {
	a := sample(t, false)
	b1, b2 := write(t, a), write(t, a)
	b3 := write(t, sample(t, true))
	if !bytes.Equal(b1, b2) || !bytes.Equal(b1, b3) {
		t.Fatal("same entries gave different archives")
	}
	if len(b1)%4 != 0 {
		t.Fatalf("archive length %d not 4-aligned", len(b1))
	}
}

// TestHeaders walks the raw archive independently of Read, checking the
// fields that make output reproducible and bootable.
func TestHeaders(t *testing.T) {
	b := write(t, sample(t, false))
	var names []string
	for off, ino := 0, uint64(1); ; ino++ {
		if off%4 != 0 {
			t.Fatalf("header at %d not aligned", off)
		}
		h := string(b[off : off+110])
		field := func(i int) uint64 {
			v, err := strconv.ParseUint(h[6+8*i:14+8*i], 16, 32)
			if err != nil {
				t.Fatal(err)
			}
			return v
		}
		if h[:6] != "070701" {
			t.Fatalf("magic %q at %d", h[:6], off)
		}
		namesize := int(field(11))
		name := string(b[off+110 : off+110+namesize-1])
		if field(5) != 0 {
			t.Errorf("%s: mtime %d", name, field(5))
		}
		if field(12) != 0 {
			t.Errorf("%s: check %d", name, field(12))
		}
		off += 110 + namesize
		off += (4 - off%4) % 4
		off += int(field(6))
		off += (4 - off%4) % 4
		if name == trailer {
			if off != len(b) {
				t.Fatalf("trailer ends at %d of %d", off, len(b))
			}
			break
		}
		if field(0) != ino {
			t.Errorf("%s: ino %d want %d", name, field(0), ino)
		}
		names = append(names, name)
	}
	if !sort.StringsAreSorted(names) {
		t.Errorf("names not sorted: %v", names)
	}
	want := "bin bin/busybox bin/sh dev dev/console etc etc/empty etc/hostname home home/agent init lib lib/modules lib/modules/x lib/modules/x/a-b.ko proc tmp usr usr/bin usr/bin/head"
	if got := strings.Join(names, " "); got != want {
		t.Errorf("names:\n got %s\nwant %s", got, want)
	}
}

func TestReadRoundTrip(t *testing.T) {
	entries, err := Read(bytes.NewReader(write(t, sample(t, false))))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]Entry{}
	for _, e := range entries {
		got[e.Name] = e
	}
	check := func(name string, mode fs.FileMode, data, link string) {
		t.Helper()
		e, ok := got[name]
		if !ok {
			t.Fatalf("%s missing", name)
		}
		if e.Mode != mode || string(e.Data) != data || e.Linkname != link {
			t.Errorf("%s: mode %v data %q link %q; want %v %q %q", name, e.Mode, e.Data, e.Linkname, mode, data, link)
		}
	}
	check("init", 0o755, "#!agent binary", "")
	check("etc/empty", 0o644, "", "")
	check("tmp", fs.ModeDir|fs.ModeSticky|0o777, "", "")
	check("lib", fs.ModeDir|0o700, "", "")
	check("lib/modules", fs.ModeDir|0o755, "", "")
	check("usr/bin/head", fs.ModeSymlink|0o777, "", "/bin/busybox")
	check("dev/console", fs.ModeDevice|fs.ModeCharDevice|0o600, "", "")
	if c := got["dev/console"]; c.Major != 5 || c.Minor != 1 {
		t.Errorf("console rdev %d:%d", c.Major, c.Minor)
	}
	if h := got["home/agent"]; h.UID != 1000 || h.GID != 1000 {
		t.Errorf("home/agent owner %d:%d", h.UID, h.GID)
	}
	if _, err := Read(bytes.NewReader(write(t, sample(t, false))[:200])); err == nil {
		t.Error("Read of truncated archive succeeded")
	}
}

func needCpio(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("cpio")
	if err != nil {
		t.Skip("GNU cpio not installed (apt-get install cpio); skipping cross-check")
	}
	return p
}

// TestGNUCpioExtracts checks the writer against GNU cpio, an independent
// newc implementation.
func TestGNUCpioExtracts(t *testing.T) {
	cpio := needCpio(t)
	b := write(t, sample(t, false))

	cmd := exec.Command(cpio, "-t", "-v", "--numeric-uid-gid", "--quiet")
	cmd.Stdin = bytes.NewReader(b)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("cpio -t: %v\n%s", err, out)
	}
	listing := string(out)
	for _, want := range []string{"crw-------", "drwxrwxrwt", "bin/sh -> busybox", "usr/bin/head -> /bin/busybox", "1000     1000 ", "0        0 "} {
		if !strings.Contains(listing, want) {
			t.Errorf("cpio -t -v lacks %q:\n%s", want, listing)
		}
	}

	// Extract everything but the device node, which needs privileges.
	a := sample(t, false)
	delete(a.entries, "dev/console")
	dir := t.TempDir()
	cmd = exec.Command(cpio, "-i", "-d", "--quiet", "--no-absolute-filenames", "--no-preserve-owner")
	cmd.Dir = dir
	cmd.Stdin = bytes.NewReader(write(t, a))
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("cpio -i: %v\n%s", err, out)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "init")); err != nil || string(b) != "#!agent binary" {
		t.Errorf("init: %q %v", b, err)
	}
	if fi, err := os.Stat(filepath.Join(dir, "init")); err != nil || fi.Mode().Perm() != 0o755 {
		t.Errorf("init mode: %v %v", fi, err)
	}
	if l, err := os.Readlink(filepath.Join(dir, "usr/bin/head")); err != nil || l != "/bin/busybox" {
		t.Errorf("usr/bin/head -> %q %v", l, err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "bin/sh")); err != nil || string(b) != "bb" {
		t.Errorf("bin/sh through link: %q %v", b, err)
	}
	if fi, err := os.Stat(filepath.Join(dir, "tmp")); err != nil || fi.Mode()&fs.ModeSticky == 0 {
		t.Errorf("tmp: %v %v", fi, err)
	}
}

// TestReadGNUCpio checks Read against an archive GNU cpio wrote.
func TestReadGNUCpio(t *testing.T) {
	cpio := needCpio(t)
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "a/b"), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "a/b/f"), []byte("hello"), 0o640); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("b/f", filepath.Join(dir, "a/l")); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(cpio, "-o", "-H", "newc", "--quiet")
	cmd.Dir = dir
	cmd.Stdin = strings.NewReader("a\na/b\na/b/f\na/l\n")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("cpio -o: %v", err)
	}
	entries, err := Read(bytes.NewReader(out))
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 4 {
		t.Fatalf("got %d entries", len(entries))
	}
	if e := entries[2]; e.Name != "a/b/f" || string(e.Data) != "hello" || e.Mode != 0o640 {
		t.Errorf("file entry %+v", e)
	}
	if e := entries[3]; e.Linkname != "b/f" || e.Mode.Type() != fs.ModeSymlink {
		t.Errorf("link entry %+v", e)
	}
	if e := entries[1]; e.Mode != fs.ModeDir|0o750 {
		t.Errorf("dir entry %+v", e)
	}
}

func TestAddRejects(t *testing.T) {
	a := New()
	if err := a.File("etc/passwd", 0o644, []byte("x")); err != nil {
		t.Fatal(err)
	}
	bad := map[string]Entry{
		"empty name":     {Name: ""},
		"root":           {Name: "/"},
		"dotdot":         {Name: "../x"},
		"inner dotdot":   {Name: "a/../../x"},
		"unclean":        {Name: "a//b"},
		"nul":            {Name: "a\x00b"},
		"long":           {Name: strings.Repeat("a", maxName+1)},
		"duplicate":      {Name: "etc/passwd", Mode: 0o644},
		"under a file":   {Name: "etc/passwd/x", Mode: 0o644},
		"dir over file":  {Name: "etc/passwd", Mode: fs.ModeDir | 0o755},
		"empty symlink":  {Name: "l", Mode: fs.ModeSymlink},
		"data on dir":    {Name: "d", Mode: fs.ModeDir, Data: []byte("x")},
		"both contents":  {Name: "f", Data: []byte("x"), Source: "/etc/hostname"},
		"missing source": {Name: "f", Source: "/nonexistent/file"},
		"dir source":     {Name: "f", Source: "/"},
		"socket":         {Name: "s", Mode: fs.ModeSocket},
		"temporary bit":  {Name: "f", Mode: fs.ModeTemporary},
	}
	for name, e := range bad {
		if err := a.Add(e); err == nil {
			t.Errorf("%s: Add(%q) succeeded", name, e.Name)
		}
	}
	// An implied parent may be given its real mode later.
	if err := a.Dir("etc", 0o700); err != nil {
		t.Errorf("explicit dir over implied parent: %v", err)
	}
	if err := a.Dir("etc", 0o700); err == nil {
		t.Error("second explicit dir accepted")
	}
	if !a.Has("/etc/passwd") || a.Has("etc/shadow") {
		t.Error("Has is wrong")
	}
}

func TestSourceChangedSize(t *testing.T) {
	src := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(src, []byte("abc"), 0o644); err != nil {
		t.Fatal(err)
	}
	a := New()
	if err := a.FileFrom("f", 0o644, src); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(src, []byte("abcd"), 0o644); err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	if _, err := a.WriteTo(&b); err == nil || !strings.Contains(err.Error(), "changed size") {
		t.Fatalf("WriteTo after source grew: %v", err)
	}
}
