package debian

import (
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/carrel-os/carrel/guest-agent/egress"
)

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: configure chowns homes and /workspace")
	}
}

const (
	fakePasswd  = "root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"
	fakeGroup   = "root:x:0:\nusers:x:100:\n"
	fakeShadow  = "root:*:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n"
	fakeGshadow = "root:*::\nusers:*::\n"
	fakeRelease = "PRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\nID=debian\n"
)

// fakeRoot makes the part of a fresh Debian root that configure reads,
// with /etc/resolv.conf a link to a file outside the root. It returns the
// root and that outside file.
func fakeRoot(t *testing.T) (root, outside string) {
	t.Helper()
	root = t.TempDir()
	outside = filepath.Join(t.TempDir(), "host-resolv.conf")
	writeTestFile(t, outside, "nameserver 192.0.2.53\n", 0o644)
	for p, c := range map[string]struct {
		content string
		mode    fs.FileMode
	}{
		"etc/passwd":          {fakePasswd, 0o644},
		"etc/group":           {fakeGroup, 0o644},
		"etc/shadow":          {fakeShadow, 0o640},
		"etc/gshadow":         {fakeGshadow, 0o640},
		"etc/skel/.bashrc":    {"# bashrc\n", 0o644},
		"etc/skel/.profile":   {"# profile\n", 0o644},
		"usr/lib/os-release":  {fakeRelease, 0o644},
		"usr/bin/placeholder": {"", 0o755},
	} {
		writeTestFile(t, filepath.Join(root, p), c.content, c.mode)
	}
	mustSymlink(t, "../usr/lib/os-release", filepath.Join(root, "etc/os-release"))
	mustSymlink(t, outside, filepath.Join(root, "etc/resolv.conf"))
	mustSymlink(t, "usr/bin", filepath.Join(root, "bin")) // merged /usr
	return root, outside
}

func writeTestFile(t *testing.T, p, content string, mode fs.FileMode) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, mode); err != nil {
		t.Fatal(err)
	}
}

func mustSymlink(t *testing.T, target, link string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(link), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
}

func readTestFile(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func configureSpec() *Spec {
	return &Spec{
		Name:     "testimg",
		Suite:    "bookworm",
		Packages: []string{"bash"},
		Users: []User{
			{Name: "alice", UID: 1000, Home: "/home/alice", Shell: "/bin/bash", Groups: []string{"users"}},
			{Name: "bob", UID: 1001, Home: "/home/bob", Shell: "/bin/sh"},
		},
		Files: []File{{Path: "/etc/motd", Mode: "0600", Content: "welcome\n"}},
		Env:   map[string]string{"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
	}
}

func checkOwner(t *testing.T, p string, uid int) {
	t.Helper()
	fi, err := os.Lstat(p)
	if err != nil {
		t.Error(err)
		return
	}
	st := fi.Sys().(*syscall.Stat_t)
	if int(st.Uid) != uid || int(st.Gid) != uid {
		t.Errorf("%s owned by %d:%d, want %d:%d", p, st.Uid, st.Gid, uid, uid)
	}
}

func checkMode(t *testing.T, p string, want fs.FileMode) {
	t.Helper()
	fi, err := os.Lstat(p)
	if err != nil {
		t.Error(err)
		return
	}
	if !fi.Mode().IsRegular() {
		t.Errorf("%s is %v, want a regular file", p, fi.Mode().Type())
	}
	if got := fi.Mode() & (fs.ModePerm | fs.ModeSetuid | fs.ModeSetgid | fs.ModeSticky); got != want {
		t.Errorf("%s mode %v, want %v", p, got, want)
	}
}

func TestConfigure(t *testing.T) {
	requireRoot(t)
	root, outside := fakeRoot(t)
	s := configureSpec()
	if err := s.Validate(); err != nil {
		t.Fatal(err)
	}
	if err := configure(root, s); err != nil {
		t.Fatalf("configure: %v", err)
	}
	etc := func(p string) string { return filepath.Join(root, "etc", p) }

	// Account files: exactly the old entries and the new ones, with no
	// build-day stamp in shadow.
	if got, want := readTestFile(t, etc("passwd")), fakePasswd+
		"alice:x:1000:1000:alice:/home/alice:/bin/bash\n"+
		"bob:x:1001:1001:bob:/home/bob:/bin/sh\n"; got != want {
		t.Errorf("passwd:\n%s\nwant:\n%s", got, want)
	}
	if got, want := readTestFile(t, etc("group")),
		"root:x:0:\nusers:x:100:alice\nalice:x:1000:\nbob:x:1001:\n"; got != want {
		t.Errorf("group:\n%s\nwant:\n%s", got, want)
	}
	if Epoch/86400 != 19723 {
		t.Fatalf("Epoch/86400 = %d", Epoch/86400)
	}
	if got, want := readTestFile(t, etc("shadow")), fakeShadow+
		"alice:*:19723:0:99999:7:::\n"+
		"bob:*:19723:0:99999:7:::\n"; got != want {
		t.Errorf("shadow:\n%s\nwant:\n%s", got, want)
	}
	if got, want := readTestFile(t, etc("gshadow")), fakeGshadow+"alice:!::\nbob:!::\n"; got != want {
		t.Errorf("gshadow:\n%s\nwant:\n%s", got, want)
	}
	checkMode(t, etc("shadow"), 0o640)
	checkMode(t, etc("gshadow"), 0o640)
	checkMode(t, etc("passwd"), 0o644)

	// Homes from /etc/skel, owned by their users.
	for _, u := range s.Users {
		home := filepath.Join(root, u.Home)
		checkOwner(t, home, u.UID)
		for _, f := range []string{".bashrc", ".profile"} {
			checkOwner(t, filepath.Join(home, f), u.UID)
			if got, want := readTestFile(t, filepath.Join(home, f)), readTestFile(t, etc("skel/"+f)); got != want {
				t.Errorf("%s/%s = %q, want %q", u.Home, f, got, want)
			}
		}
	}
	if fi, err := os.Stat(filepath.Join(root, "workspace")); err != nil || !fi.IsDir() {
		t.Errorf("/workspace: %v, %v", fi, err)
	}
	checkOwner(t, filepath.Join(root, "workspace"), 1000)

	// Environment, sorted.
	if got, want := readTestFile(t, etc("environment")),
		"LANG=\"C.UTF-8\"\nPATH=\"/usr/local/bin:/usr/bin:/bin\"\n"; got != want {
		t.Errorf("environment:\n%s\nwant:\n%s", got, want)
	}
	if got, want := readTestFile(t, etc("profile.d/carrel-env.sh")),
		"export LANG=\"C.UTF-8\"\nexport PATH=\"/usr/local/bin:/usr/bin:/bin\"\n"; got != want {
		t.Errorf("carrel-env.sh:\n%s\nwant:\n%s", got, want)
	}

	// Network: every tool points at the proxy, and nothing resolves.
	addr := egress.HTTPProxyAddr
	if !strings.Contains(readTestFile(t, etc("apt/apt.conf.d/80carrel-proxy")), `Acquire::http::Proxy "http://`+addr+`/";`) {
		t.Errorf("apt proxy config lacks Acquire::http::Proxy for %s", addr)
	}
	if !strings.Contains(readTestFile(t, etc("apt/apt.conf.d/80carrel-proxy")), `Acquire::https::Proxy "http://`+addr+`/";`) {
		t.Errorf("apt proxy config lacks Acquire::https::Proxy for %s", addr)
	}
	for _, p := range []string{"pip.conf", "npmrc", "gitconfig", "wgetrc", "profile.d/carrel-proxy.sh"} {
		checkMode(t, etc(p), 0o644)
		if !strings.Contains(readTestFile(t, etc(p)), "http://"+addr) {
			t.Errorf("/etc/%s does not name the proxy http://%s", p, addr)
		}
	}
	for _, p := range []string{"resolv.conf", "hostname", "hosts", "apt/apt.conf.d/80carrel-proxy"} {
		checkMode(t, etc(p), 0o644)
	}
	for _, l := range strings.Split(readTestFile(t, etc("resolv.conf")), "\n") {
		if strings.HasPrefix(strings.TrimSpace(l), "nameserver") {
			t.Errorf("resolv.conf has a resolver: %q", l)
		}
	}
	if got := readTestFile(t, etc("hostname")); got != "carrel\n" {
		t.Errorf("hostname = %q", got)
	}
	if hosts := readTestFile(t, etc("hosts")); !strings.Contains(hosts, "127.0.0.1\tlocalhost") || !strings.Contains(hosts, "carrel") {
		t.Errorf("hosts = %q", hosts)
	}
	// The link was replaced, not written through.
	if got := readTestFile(t, outside); got != "nameserver 192.0.2.53\n" {
		t.Errorf("file outside the root that resolv.conf linked to was changed: %q", got)
	}

	// os-release is a file of its own that names the image; the original
	// is untouched.
	checkMode(t, etc("os-release"), 0o644)
	if got, want := readTestFile(t, etc("os-release")), fakeRelease+"IMAGE_ID=testimg\n"; !strings.HasPrefix(got, want) {
		t.Errorf("os-release = %q, want prefix %q", got, want)
	}
	if got := readTestFile(t, filepath.Join(root, "usr/lib/os-release")); got != fakeRelease {
		t.Errorf("usr/lib/os-release changed: %q", got)
	}

	// The spec's files, with their modes past the umask.
	checkMode(t, etc("motd"), 0o600)
	if got := readTestFile(t, etc("motd")); got != "welcome\n" {
		t.Errorf("motd = %q", got)
	}
}

func TestConfigureTwiceFails(t *testing.T) {
	requireRoot(t)
	root, _ := fakeRoot(t)
	s := configureSpec()
	if err := configure(root, s); err != nil {
		t.Fatalf("configure: %v", err)
	}
	passwd := readTestFile(t, filepath.Join(root, "etc/passwd"))
	group := readTestFile(t, filepath.Join(root, "etc/group"))
	err := configure(root, s)
	if err == nil {
		t.Fatal("second configure succeeded")
	}
	if !strings.Contains(err.Error(), "alice") || !strings.Contains(err.Error(), "already") {
		t.Errorf("second configure error %q does not say the user exists", err)
	}
	if got := readTestFile(t, filepath.Join(root, "etc/passwd")); got != passwd {
		t.Errorf("passwd changed by the failed configure:\n%s", got)
	}
	if got := readTestFile(t, filepath.Join(root, "etc/group")); got != group {
		t.Errorf("group changed by the failed configure:\n%s", got)
	}
}

func TestConfigureExistingUserFails(t *testing.T) {
	requireRoot(t)
	root, _ := fakeRoot(t)
	s := configureSpec()
	s.Users = []User{{Name: "daemon", UID: 1000, Home: "/home/daemon", Shell: "/bin/sh"}}
	err := configure(root, s)
	if err == nil || !strings.Contains(err.Error(), "daemon") {
		t.Fatalf("configure with a system user's name = %v, want an error naming daemon", err)
	}
}

func TestConfigureMissingGroup(t *testing.T) {
	requireRoot(t)
	root, _ := fakeRoot(t)
	s := configureSpec()
	s.Users[1].Groups = []string{"docker"}
	err := configure(root, s)
	if err == nil || !strings.Contains(err.Error(), `"docker"`) {
		t.Fatalf("configure with a missing group = %v, want an error naming docker", err)
	}
}

// TestConfigureSpecialModes checks that a spec's setuid, setgid and sticky
// bits reach the file.
func TestConfigureSpecialModes(t *testing.T) {
	requireRoot(t)
	root, _ := fakeRoot(t)
	s := configureSpec()
	s.Files = []File{
		{Path: "/usr/local/bin/suid", Mode: "4755", Content: "x"},
		{Path: "/usr/local/bin/sgid", Mode: "2711", Content: "x"},
		{Path: "/usr/local/share/sticky", Mode: "1644", Content: "x"},
		{Path: "/etc/secret", Mode: "0000", Content: "x"},
	}
	if err := configure(root, s); err != nil {
		t.Fatalf("configure: %v", err)
	}
	checkMode(t, filepath.Join(root, "usr/local/bin/suid"), fs.ModeSetuid|0o755)
	checkMode(t, filepath.Join(root, "usr/local/bin/sgid"), fs.ModeSetgid|0o711)
	checkMode(t, filepath.Join(root, "usr/local/share/sticky"), fs.ModeSticky|0o644)
	checkMode(t, filepath.Join(root, "etc/secret"), 0)
}

// TestConfigureFileStaysInRoot checks that a spec's file is never written
// through a link out of the root: Debian's /var/run is a link to the
// absolute /run, which on the build host is the host's.
func TestConfigureFileStaysInRoot(t *testing.T) {
	requireRoot(t)
	for _, tc := range []struct{ link, path string }{
		{"var/run", "/var/run/evil"},       // absolute link
		{"usr/lib/up", "/usr/lib/up/evil"}, // relative link that climbs out
	} {
		t.Run(tc.link, func(t *testing.T) {
			root, _ := fakeRoot(t)
			host := t.TempDir()
			target := host
			if tc.link == "usr/lib/up" {
				var err error
				if target, err = filepath.Rel(filepath.Join(root, "usr/lib"), host); err != nil {
					t.Fatal(err)
				}
			}
			mustSymlink(t, target, filepath.Join(root, tc.link))
			s := configureSpec()
			s.Files = []File{{Path: tc.path, Mode: "0644", Content: "evil\n"}}
			if err := configure(root, s); err == nil {
				t.Errorf("configure wrote %s through a link out of the root", tc.path)
			}
			if ents, _ := os.ReadDir(host); len(ents) != 0 {
				t.Errorf("configure wrote %s outside the root: %v", tc.path, ents)
			}
		})
	}
}

// TestConfigureFollowsLinksInRoot checks that links inside the root (the
// merged /usr's /bin) still work for a spec's files.
func TestConfigureFollowsLinksInRoot(t *testing.T) {
	requireRoot(t)
	root, _ := fakeRoot(t)
	s := configureSpec()
	s.Files = []File{{Path: "/bin/tool", Mode: "0755", Content: "#!/bin/sh\n"}}
	if err := configure(root, s); err != nil {
		t.Fatalf("configure: %v", err)
	}
	checkMode(t, filepath.Join(root, "usr/bin/tool"), 0o755)
}

func TestWriteFileReplacesLink(t *testing.T) {
	root := t.TempDir()
	outside := filepath.Join(t.TempDir(), "target")
	writeTestFile(t, outside, "host\n", 0o644)
	mustSymlink(t, outside, filepath.Join(root, "etc/x"))
	if err := writeFile(root, "/etc/x", 0o640, "new\n"); err != nil {
		t.Fatal(err)
	}
	checkMode(t, filepath.Join(root, "etc/x"), 0o640)
	if got := readTestFile(t, filepath.Join(root, "etc/x")); got != "new\n" {
		t.Errorf("etc/x = %q", got)
	}
	if got := readTestFile(t, outside); got != "host\n" {
		t.Errorf("link target outside the root changed: %q", got)
	}
	// An existing file is replaced and its mode set.
	if err := writeFile(root, "/etc/x", 0o600, "n\n"); err != nil { // shorter: truncated
		t.Fatal(err)
	}
	checkMode(t, filepath.Join(root, "etc/x"), 0o600)
	if got := readTestFile(t, filepath.Join(root, "etc/x")); got != "n\n" {
		t.Errorf("etc/x = %q", got)
	}
}
