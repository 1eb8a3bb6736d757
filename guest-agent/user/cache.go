package user

import (
	"os"
	"slices"
	"sync"
	"syscall"
)

// maxCached bounds a Cache; a full one starts over.
const maxCached = 64

// Cache remembers what Lookup found until the passwd or group file
// changes: its inode, size, modification or change time. useradd and its
// kin replace the files by renaming a new one over them, which changes the
// inode, and an edit in place changes the times. Reading both files on
// every command costs an emulated guest about a millisecond; two stats
// cost a tenth of that. Errors are not remembered. The zero value is
// ready to use; a Cache must not be copied.
type Cache struct {
	mu     sync.Mutex
	stamps [2]stamp
	users  map[string]*User
}

// stamp is what says a file changed.
type stamp struct {
	path         string
	ok           bool // the file exists
	ino, size    int64
	mtime, ctime int64 // ns
}

func stampOf(path string) stamp {
	s := stamp{path: path}
	fi, err := os.Stat(path)
	if err != nil {
		return s
	}
	s.ok, s.size, s.mtime = true, fi.Size(), fi.ModTime().UnixNano()
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		s.ino, s.ctime = int64(st.Ino), st.Ctim.Nano()
	}
	return s
}

// Lookup is f.Lookup(spec), from the cache while f's files are unchanged.
// The User returned is the caller's own.
func (c *Cache) Lookup(f Files, spec string) (*User, error) {
	stamps := [2]stamp{stampOf(orDefault(f.Passwd, "/etc/passwd")), stampOf(orDefault(f.Group, "/etc/group"))}
	c.mu.Lock()
	if stamps != c.stamps || len(c.users) >= maxCached {
		c.stamps, c.users = stamps, nil
	}
	u, ok := c.users[spec]
	c.mu.Unlock()
	if ok {
		return u.clone(), nil
	}
	u, err := f.Lookup(spec)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	if c.stamps == stamps { // nothing changed while we read
		if c.users == nil {
			c.users = make(map[string]*User)
		}
		c.users[spec] = u.clone()
	}
	c.mu.Unlock()
	return u, nil
}

func (u *User) clone() *User {
	v := *u
	v.Groups = slices.Clone(u.Groups)
	return &v
}
