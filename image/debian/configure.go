package debian

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/carrel-os/carrel/guest-agent/egress"
)

// proxy is carrel-agent's HTTP proxy in the guest, the VM's only way out.
var proxy = "http://" + egress.HTTPProxyAddr

// networkConfig points every network tool of the image at the proxy:
// the environment reaches most of them (carrel-agent sets HTTP_PROXY and
// the like for every command), but apt ignores it and the others are
// configured too, so that a login shell or a daemon gets the same. The
// guest has no resolver: names are resolved by carreld, through the
// proxy.
var networkConfig = []struct {
	path, content string
}{
	{"/etc/apt/apt.conf.d/80carrel-proxy", fmt.Sprintf("// carrel: the VM reaches the network only through carrel-agent's proxy.\nAcquire::http::Proxy %q;\nAcquire::https::Proxy %q;\n", proxy+"/", proxy+"/")},
	{"/etc/pip.conf", fmt.Sprintf("# carrel: the VM reaches the network only through carrel-agent's proxy.\n[global]\nproxy = %s\n", proxy)},
	{"/etc/npmrc", fmt.Sprintf("# carrel: the VM reaches the network only through carrel-agent's proxy.\nproxy=%s/\nhttps-proxy=%s/\n", proxy, proxy)},
	{"/etc/gitconfig", fmt.Sprintf("# carrel: the VM reaches the network only through carrel-agent's proxy.\n[http]\n\tproxy = %s\n", proxy)},
	{"/etc/wgetrc", fmt.Sprintf("# carrel: the VM reaches the network only through carrel-agent's proxy.\nuse_proxy = on\nhttp_proxy = %s/\nhttps_proxy = %s/\n", proxy, proxy)},
	{"/etc/profile.d/carrel-proxy.sh", fmt.Sprintf("# carrel: the VM reaches the network only through carrel-agent's proxy.\nexport http_proxy=%[1]s HTTP_PROXY=%[1]s https_proxy=%[1]s HTTPS_PROXY=%[1]s no_proxy=localhost,127.0.0.1,::1 NO_PROXY=localhost,127.0.0.1,::1\n", proxy)},
	{"/etc/resolv.conf", "# carrel: this VM has no network interface and no resolver of its own.\n# Names are resolved by carreld for each connection through the proxy.\n"},
	{"/etc/hostname", "carrel\n"},
	{"/etc/hosts", "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\tcarrel\n"},
}

// configure adds the spec's users, files and environment, the network
// configuration, /workspace, and the image's name in os-release.
func configure(root string, s *Spec) error {
	for _, c := range networkConfig {
		if err := writeFile(root, c.path, 0o644, c.content); err != nil {
			return err
		}
	}
	for _, u := range s.Users {
		if err := addUser(root, u); err != nil {
			return fmt.Errorf("user %s: %w", u.Name, err)
		}
	}
	first := s.Users[0]
	if err := os.MkdirAll(filepath.Join(root, "workspace"), 0o755); err != nil {
		return err
	}
	if err := os.Chown(filepath.Join(root, "workspace"), first.UID, first.UID); err != nil {
		return err
	}
	if err := writeEnv(root, s.Env); err != nil {
		return err
	}
	if err := writeOSRelease(root, s.Name); err != nil {
		return err
	}
	for _, f := range s.Files {
		perm, _ := f.perm() // validated
		if err := writeFile(root, f.Path, perm, f.Content); err != nil {
			return err
		}
	}
	return nil
}

// writeFile writes content at p in root, replacing a file or a link there
// (never following one out of root). Links in the directories above it
// are resolved within root, and one that leaves it (an absolute link, as
// Debian's /var/run is) is an error: followed, it would reach the host's.
func writeFile(root, p string, perm fs.FileMode, content string) error {
	r, err := os.OpenRoot(root)
	if err != nil {
		return err
	}
	defer r.Close()
	rel := strings.TrimPrefix(filepath.Clean("/"+p), "/")
	if err := r.MkdirAll(filepath.Dir(rel), 0o755); err != nil {
		return fmt.Errorf("write %s: %w", p, err)
	}
	if fi, err := r.Lstat(rel); err == nil && !fi.Mode().IsRegular() {
		if err := r.Remove(rel); err != nil {
			return fmt.Errorf("replace %s: %w", p, err)
		}
	}
	if err := r.WriteFile(rel, []byte(content), perm.Perm()); err != nil {
		return fmt.Errorf("write %s: %w", p, err)
	}
	return r.Chmod(rel, perm) // past the umask
}

// addUser appends the user, its group and their shadow entries, and makes
// its home from /etc/skel. The entries are written here rather than by
// useradd, which stamps the day of the build into /etc/shadow.
func addUser(root string, u User) error {
	days := Epoch / 86400
	id := strconv.Itoa(u.UID)
	for _, add := range [][2]string{
		{"etc/passwd", fmt.Sprintf("%s:x:%s:%s:%s:%s:%s\n", u.Name, id, id, u.Name, u.Home, u.Shell)},
		{"etc/group", fmt.Sprintf("%s:x:%s:\n", u.Name, id)},
		{"etc/shadow", fmt.Sprintf("%s:*:%d:0:99999:7:::\n", u.Name, days)},
		{"etc/gshadow", fmt.Sprintf("%s:!::\n", u.Name)},
	} {
		if err := appendEntry(filepath.Join(root, add[0]), add[1]); err != nil {
			return err
		}
	}
	for _, g := range u.Groups {
		if err := joinGroup(filepath.Join(root, "etc/group"), g, u.Name); err != nil {
			return err
		}
	}
	home := filepath.Join(root, u.Home)
	if err := os.MkdirAll(home, 0o755); err != nil {
		return err
	}
	skel := filepath.Join(root, "etc/skel")
	ents, _ := os.ReadDir(skel)
	for _, e := range ents {
		if !e.Type().IsRegular() {
			continue
		}
		b, err := os.ReadFile(filepath.Join(skel, e.Name()))
		if err != nil {
			return err
		}
		dst := filepath.Join(home, e.Name())
		if err := os.WriteFile(dst, b, 0o644); err != nil {
			return err
		}
		if err := os.Chown(dst, u.UID, u.UID); err != nil {
			return err
		}
	}
	return os.Chown(home, u.UID, u.UID)
}

// appendEntry adds line to an account file whose first field must not
// name the entry yet.
func appendEntry(path, line string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	name, _, _ := strings.Cut(line, ":")
	for _, l := range strings.Split(string(b), "\n") {
		if n, _, _ := strings.Cut(l, ":"); n == name {
			return fmt.Errorf("%s already has %q", filepath.Base(path), name)
		}
	}
	if len(b) > 0 && b[len(b)-1] != '\n' {
		b = append(b, '\n')
	}
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, line...), fi.Mode().Perm())
}

func joinGroup(path, group, user string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	found := false
	for i, l := range lines {
		f := strings.Split(l, ":")
		if len(f) != 4 || f[0] != group {
			continue
		}
		members := strings.FieldsFunc(f[3], func(r rune) bool { return r == ',' })
		if !slices.Contains(members, user) {
			members = append(members, user)
		}
		f[3] = strings.Join(members, ",")
		lines[i] = strings.Join(f, ":")
		found = true
	}
	if !found {
		return fmt.Errorf("no group %q in the image", group)
	}
	return os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"), 0o644)
}

// writeEnv writes the spec's environment to /etc/environment (which
// carrel-agent gives every command) and to a profile script.
func writeEnv(root string, env map[string]string) error {
	keys := make([]string, 0, len(env))
	for k := range env {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var plain, profile strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&plain, "%s=\"%s\"\n", k, env[k])
		fmt.Fprintf(&profile, "export %s=\"%s\"\n", k, env[k])
	}
	if err := writeFile(root, "/etc/environment", 0o644, plain.String()); err != nil {
		return err
	}
	return writeFile(root, "/etc/profile.d/carrel-env.sh", 0o644, profile.String())
}

// writeOSRelease makes /etc/os-release a file of its own (Debian's is a
// link to /usr/lib/os-release) that also names the image.
func writeOSRelease(root, name string) error {
	b, err := os.ReadFile(filepath.Join(root, "usr/lib/os-release"))
	if err != nil {
		return err
	}
	return writeFile(root, "/etc/os-release", 0o644, string(b)+"IMAGE_ID="+name+"\nVARIANT=\"carrel agent computer\"\n")
}
