package user

import (
	"os"
	"path/filepath"
	"testing"
)

func TestCacheFollowsTheFiles(t *testing.T) {
	f := files(t)
	var c Cache
	u, err := c.Lookup(f, "agent")
	if err != nil || u.UID != 1000 {
		t.Fatalf("first lookup: %+v, %v", u, err)
	}
	u.Groups[0], u.Home = 7, "/elsewhere" // the caller's own copy
	u, err = c.Lookup(f, "agent")
	if err != nil || u.Groups[0] != 1000 || u.Home != "/home/agent" || len(c.users) != 1 {
		t.Fatalf("second lookup: %+v, %v (%d cached)", u, err, len(c.users))
	}

	// Replaced as useradd does: a new file renamed over the old.
	tmp := filepath.Join(filepath.Dir(f.Passwd), "passwd+")
	if err := os.WriteFile(tmp, []byte("agent:x:2000:2000:agent:/home/agent:/bin/sh\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, f.Passwd); err != nil {
		t.Fatal(err)
	}
	if u, err = c.Lookup(f, "agent"); err != nil || u.UID != 2000 {
		t.Fatalf("after the passwd file was replaced: %+v, %v", u, err)
	}

	// A group added in place.
	g, err := os.OpenFile(f.Group, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := g.WriteString("build:x:77:agent\n"); err != nil {
		t.Fatal(err)
	}
	g.Close()
	if u, err = c.Lookup(f, "agent"); err != nil || u.Groups[len(u.Groups)-1] != 77 {
		t.Fatalf("after a group was added: %+v, %v", u, err)
	}

	// Errors are not kept, and a missing file is a change like any other.
	if _, err := c.Lookup(f, "nobody-here"); err == nil || len(c.users) != 1 {
		t.Fatalf("unknown user: %v (%d cached)", err, len(c.users))
	}
	os.Remove(f.Passwd)
	if u, err := c.Lookup(f, "agent"); err == nil {
		t.Fatalf("after the passwd file was removed: %+v", u)
	}
}
