package user

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

func files(t *testing.T) Files {
	dir := t.TempDir()
	f := Files{Passwd: filepath.Join(dir, "passwd"), Group: filepath.Join(dir, "group")}
	write := func(p, s string) {
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(f.Passwd, "# comment\nroot:x:0:0:root:/root:/bin/sh\n\n+nis\nbroken:x:zz:1::/:/bin/sh\n"+
		"agent:x:1000:1000:agent:/home/agent:/bin/sh\nnohome:x:1001:1001:::\n")
	write(f.Group, "root:x:0:\nagent:x:1000:\nwheel:x:10:root,agent\ndocker:x:999:other, agent\nvideo:x:44:x,agent\n")
	return f
}

func TestLookup(t *testing.T) {
	f := files(t)
	tests := []struct {
		spec string
		want *User
	}{
		{"agent", &User{Name: "agent", UID: 1000, GID: 1000, Home: "/home/agent", Shell: "/bin/sh", Groups: []uint32{1000, 10, 44}}},
		{"1000", &User{Name: "agent", UID: 1000, GID: 1000, Home: "/home/agent", Shell: "/bin/sh", Groups: []uint32{1000, 10, 44}}},
		{"root", &User{Name: "root", UID: 0, GID: 0, Home: "/root", Shell: "/bin/sh", Groups: []uint32{0, 10}}},
		{"nohome", &User{Name: "nohome", UID: 1001, GID: 1001, Home: "/", Groups: []uint32{1001}}},
		{"4242", &User{UID: 4242, GID: 4242, Home: "/", Groups: []uint32{4242}}},
	}
	for _, tt := range tests {
		got, err := f.Lookup(tt.spec)
		if err != nil {
			t.Fatalf("%s: %v", tt.spec, err)
		}
		if !reflect.DeepEqual(got, tt.want) {
			t.Errorf("%s: got %+v, want %+v", tt.spec, got, tt.want)
		}
	}
	for _, spec := range []string{"", "nobody", "broken", "4294967295", "99999999999", "a:b", "-1", "+nis"} {
		if _, err := f.Lookup(spec); !errors.Is(err, ErrUnknown) {
			t.Errorf("%q: %v, want ErrUnknown", spec, err)
		}
	}
}

func TestEnv(t *testing.T) {
	u := &User{Name: "agent", Home: "/home/agent", Shell: "/bin/sh"}
	want := []string{"HOME=/home/agent", "USER=agent", "LOGNAME=agent", "SHELL=/bin/sh"}
	if got := u.Env(); !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v", got)
	}
	if got := (&User{Home: "/"}).Env(); !reflect.DeepEqual(got, []string{"HOME=/"}) {
		t.Fatalf("nameless: %v", got)
	}
}

func TestNoGroupFile(t *testing.T) {
	f := files(t)
	f.Group = filepath.Join(t.TempDir(), "missing")
	u, err := f.Lookup("agent")
	if err != nil || !reflect.DeepEqual(u.Groups, []uint32{1000}) {
		t.Fatalf("%+v %v", u, err)
	}
}
