package initramfs

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// TestWriteDir lays out one entry of each kind and checks types, modes,
// content, link targets and, when the test runs as root, owners and a
// device node. As another user every entry is owned by that user, since
// only root may give files away.
func TestWriteDir(t *testing.T) {
	root := os.Getuid() == 0
	me, myGroup := uint32(os.Getuid()), uint32(os.Getgid())
	agent, agentGroup := me, myGroup
	if root {
		agent, agentGroup = 1000, 1001
	}
	src := filepath.Join(t.TempDir(), "src")
	if err := os.WriteFile(src, []byte("from the host"), 0o600); err != nil {
		t.Fatal(err)
	}
	a := New()
	add := func(e Entry) {
		t.Helper()
		if e.UID == 0 && e.GID == 0 {
			e.UID, e.GID = me, myGroup // root when root
		}
		if err := a.Add(e); err != nil {
			t.Fatal(err)
		}
	}
	// Parents nobody adds are root's, which only root can give them.
	implied := []string{"etc", "bin", "usr", "usr/bin", "usr/lib", "usr/lib/ro/sub", "home"}
	if !root {
		for _, d := range implied {
			add(Entry{Name: d, Mode: fs.ModeDir | 0o755})
		}
	}
	add(Entry{Name: "tmp", Mode: fs.ModeDir | fs.ModeSticky | 0o777})
	add(Entry{Name: "etc/hostname", Mode: 0o644, Data: []byte("carrel\n")})
	add(Entry{Name: "etc/empty", Mode: 0o600})
	add(Entry{Name: "bin/busybox", Mode: 0o755, Source: src})
	add(Entry{Name: "bin/sh", Mode: fs.ModeSymlink | 0o777, Linkname: "busybox"})
	add(Entry{Name: "usr/bin/head", Mode: fs.ModeSymlink | 0o777, Linkname: "/bin/busybox"})
	add(Entry{Name: "usr/bin/su", Mode: fs.ModeSetuid | 0o755, UID: agent, GID: agentGroup, Data: []byte("su")})
	add(Entry{Name: "usr/bin/wall", Mode: fs.ModeSetgid | 0o755, UID: agent, GID: agentGroup, Data: []byte("wall")})
	add(Entry{Name: "home/agent", Mode: fs.ModeDir | 0o700, UID: agent, GID: agentGroup})
	add(Entry{Name: "home/agent/.profile", Mode: 0o640, UID: agent, GID: agentGroup, Data: []byte("PS1=$\n")})
	// A read-only directory with contents, one level down, whose contents
	// must be written before its mode is set.
	add(Entry{Name: "usr/lib/ro", Mode: fs.ModeDir | 0o555})
	add(Entry{Name: "usr/lib/ro/sub/file", Mode: 0o444, Data: []byte("deep")})
	add(Entry{Name: "proc", Mode: fs.ModeDir | 0o555})
	if root {
		if err := a.CharDev("dev/null", 0o666, 1, 3); err != nil {
			t.Fatal(err)
		}
		if err := a.CharDev("dev/console", 0o600, 5, 1); err != nil {
			t.Fatal(err)
		}
	}

	dir := filepath.Join(t.TempDir(), "tree")
	if err := a.WriteDir(dir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { makeWritable(dir) })

	type want struct {
		mode     fs.FileMode
		uid, gid uint32
		data     string // regular files
		link     string // symlinks
	}
	wants := map[string]want{
		"tmp":                 {mode: fs.ModeDir | fs.ModeSticky | 0o777, uid: me, gid: myGroup},
		"etc/hostname":        {mode: 0o644, uid: me, gid: myGroup, data: "carrel\n"},
		"etc/empty":           {mode: 0o600, uid: me, gid: myGroup, data: ""},
		"bin/busybox":         {mode: 0o755, uid: me, gid: myGroup, data: "from the host"},
		"bin/sh":              {mode: fs.ModeSymlink, uid: me, gid: myGroup, link: "busybox"},
		"usr/bin/head":        {mode: fs.ModeSymlink, uid: me, gid: myGroup, link: "/bin/busybox"},
		"usr/bin/su":          {mode: fs.ModeSetuid | 0o755, uid: agent, gid: agentGroup, data: "su"},
		"usr/bin/wall":        {mode: fs.ModeSetgid | 0o755, uid: agent, gid: agentGroup, data: "wall"},
		"home/agent":          {mode: fs.ModeDir | 0o700, uid: agent, gid: agentGroup},
		"home/agent/.profile": {mode: 0o640, uid: agent, gid: agentGroup, data: "PS1=$\n"},
		"usr/lib/ro":          {mode: fs.ModeDir | 0o555, uid: me, gid: myGroup},
		"usr/lib/ro/sub/file": {mode: 0o444, uid: me, gid: myGroup, data: "deep"},
		"proc":                {mode: fs.ModeDir | 0o555, uid: me, gid: myGroup},
	}
	for _, d := range implied {
		wants[d] = want{mode: fs.ModeDir | 0o755, uid: me, gid: myGroup}
	}
	if root {
		wants["dev/null"] = want{mode: fs.ModeDevice | fs.ModeCharDevice | 0o666}
		wants["dev/console"] = want{mode: fs.ModeDevice | fs.ModeCharDevice | 0o600}
	}
	for name, w := range wants {
		p := filepath.Join(dir, name)
		fi, err := os.Lstat(p)
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		got := fi.Mode()
		if w.mode&fs.ModeSymlink != 0 {
			got &= fs.ModeType // a link's own permissions mean nothing
		}
		if got != w.mode {
			t.Errorf("%s: mode %v, want %v", name, fi.Mode(), w.mode)
		}
		st := fi.Sys().(*syscall.Stat_t)
		if root && (st.Uid != w.uid || st.Gid != w.gid) {
			t.Errorf("%s: owner %d:%d, want %d:%d", name, st.Uid, st.Gid, w.uid, w.gid)
		}
		switch {
		case w.mode.IsRegular():
			if b, err := os.ReadFile(p); err != nil || string(b) != w.data {
				t.Errorf("%s: %q, %v; want %q", name, b, err, w.data)
			}
		case w.mode&fs.ModeSymlink != 0:
			if l, err := os.Readlink(p); err != nil || l != w.link {
				t.Errorf("%s -> %q, %v; want %q", name, l, err, w.link)
			}
		}
	}
	if root {
		for name, dev := range map[string][2]uint32{"dev/null": {1, 3}, "dev/console": {5, 1}} {
			fi, err := os.Lstat(filepath.Join(dir, name))
			if err != nil {
				continue // reported above
			}
			rdev := fi.Sys().(*syscall.Stat_t).Rdev
			if maj, min := major(rdev), minor(rdev); maj != dev[0] || min != dev[1] {
				t.Errorf("%s: device %d:%d, want %d:%d", name, maj, min, dev[0], dev[1])
			}
		}
	} else {
		t.Log("not root: owners and device nodes not checked")
	}
	// Nothing beyond the archive's entries.
	n := 0
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && p != dir {
			n++
		}
		return err
	})
	entries := len(a.entries)
	if n != entries {
		t.Errorf("tree has %d entries, archive %d", n, entries)
	}

	// The directory must be empty or missing: nothing is laid over an
	// existing tree.
	if err := a.WriteDir(dir); err == nil || !errors.Is(err, fs.ErrExist) {
		t.Errorf("second WriteDir over the same tree: %v, want an error wrapping fs.ErrExist", err)
	}
}

func major(dev uint64) uint32 { return uint32((dev>>32)&0xfffff000 | (dev>>8)&0xfff) }
func minor(dev uint64) uint32 { return uint32((dev>>12)&0xffffff00 | dev&0xff) }

// makeWritable lets t.TempDir's cleanup remove a tree with read-only
// directories when the test does not run as root.
func makeWritable(dir string) {
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			os.Chmod(p, 0o755)
		}
		return nil
	})
}
