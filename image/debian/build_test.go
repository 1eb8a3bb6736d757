package debian

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/image/manifest"
)

const fakeStatus = `Package: zlib1g
Status: install ok installed
Priority: optional
Maintainer: Nobody <nobody@example.org>
Architecture: amd64
Version: 1:1.2.13.dfsg-1
Description: compression library

Package: bash
Essential: yes
Status: install ok installed
Priority: required
Maintainer: Nobody <nobody@example.org>
Architecture: amd64
Version: 5.2.15-2+b2
Description: shell

Package: vim
Status: deinstall ok config-files
Priority: optional
Maintainer: Nobody <nobody@example.org>
Architecture: amd64
Version: 2:9.0.1378-2
Description: editor
`

func requireTool(t *testing.T, name string) {
	t.Helper()
	if _, err := exec.LookPath(name); err != nil {
		t.Skipf("needs %s: %v", name, err)
	}
}

func discard() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func TestInstalled(t *testing.T) {
	requireTool(t, "dpkg-query")
	tree := t.TempDir()
	writeTestFile(t, filepath.Join(tree, "var/lib/dpkg/status"), fakeStatus, 0o644)
	got, err := installed(context.Background(), tree)
	if err != nil {
		t.Fatalf("installed: %v", err)
	}
	want := []manifest.Package{
		{Name: "bash", Version: "5.2.15-2+b2", Arch: "amd64"},
		{Name: "zlib1g", Version: "1:1.2.13.dfsg-1", Arch: "amd64"},
	}
	if !slices.Equal(got, want) {
		t.Errorf("installed = %+v, want %+v", got, want)
	}
}

func TestInstalledNone(t *testing.T) {
	requireTool(t, "dpkg-query")
	tree := t.TempDir()
	writeTestFile(t, filepath.Join(tree, "var/lib/dpkg/status"), "", 0o644)
	if got, err := installed(context.Background(), tree); err == nil {
		t.Errorf("installed with an empty status = %+v, want an error", got)
	}
	// Only packages whose configuration is left.
	writeTestFile(t, filepath.Join(tree, "var/lib/dpkg/status"), fakeStatus[strings.Index(fakeStatus, "Package: vim"):], 0o644)
	if got, err := installed(context.Background(), tree); err == nil {
		t.Errorf("installed with no installed package = %+v, want an error", got)
	}
}

func TestInstalledNoAdmindir(t *testing.T) {
	requireTool(t, "dpkg-query")
	if got, err := installed(context.Background(), t.TempDir()); err == nil {
		t.Errorf("installed without a dpkg database = %+v, want an error", got)
	}
}

var aptWhitelist = []string{
	"Acquire::Check-Valid-Until", "Acquire::Check-Date",
	"Acquire::http::Proxy", "Acquire::https::Proxy", "Acquire::Retries",
}

func checkWhitelisted(t *testing.T, opts []string) {
	t.Helper()
	for _, o := range opts {
		k, _, _ := strings.Cut(o, " ")
		if !slices.Contains(aptWhitelist, k) {
			t.Errorf("hostAptOptions returned %q, not a whitelisted key", o)
		}
		if strings.HasSuffix(o, ";") {
			t.Errorf("hostAptOptions returned %q with its semicolon", o)
		}
	}
}

func TestHostAptOptionsHost(t *testing.T) {
	requireTool(t, "apt-config")
	checkWhitelisted(t, hostAptOptions(context.Background()))
}

func TestHostAptOptionsFiltered(t *testing.T) {
	bin := t.TempDir()
	dump := `APT "";
APT::Architecture "amd64";
Acquire::http::Proxy "http://proxy.example:3128/";
Acquire::http::Proxy::deb.example "DIRECT";
Acquire::Check-Valid-Until "false";
Acquire::Retries "3";
Dir::Etc::sourcelist "/tmp/evil.list";
DPkg::Pre-Invoke:: "touch /tmp/pwned";
Acquire::https::Proxy "http://proxy.example:3128/";
`
	writeTestFile(t, filepath.Join(bin, "apt-config"), "#!/bin/sh\ncat <<'END'\n"+dump+"END\n", 0o755)
	t.Setenv("PATH", bin+string(os.PathListSeparator)+os.Getenv("PATH")) // ours first
	got := hostAptOptions(context.Background())
	want := []string{
		`Acquire::http::Proxy "http://proxy.example:3128/"`,
		`Acquire::Check-Valid-Until "false"`,
		`Acquire::Retries "3"`,
		`Acquire::https::Proxy "http://proxy.example:3128/"`,
	}
	if !slices.Equal(got, want) {
		t.Errorf("hostAptOptions = %q, want %q", got, want)
	}
	checkWhitelisted(t, got)

	// A failing apt-config gives nothing.
	writeTestFile(t, filepath.Join(bin, "apt-config"), "#!/bin/sh\necho 'Acquire::Retries \"3\";'\nexit 1\n", 0o755)
	if got := hostAptOptions(context.Background()); got != nil {
		t.Errorf("hostAptOptions with a failing apt-config = %q, want nil", got)
	}
	t.Setenv("PATH", t.TempDir())
	if got := hostAptOptions(context.Background()); got != nil {
		t.Errorf("hostAptOptions without apt-config = %q, want nil", got)
	}
}

func TestHostSources(t *testing.T) {
	srcs, err := HostSources()
	if err != nil {
		t.Skipf("host has no apt sources: %v", err)
	}
	if len(srcs) == 0 {
		t.Fatal("HostSources returned nothing and no error")
	}
	if !slices.IsSorted(srcs) {
		t.Errorf("HostSources not sorted: %v", srcs)
	}
	for _, s := range srcs {
		fi, err := os.Stat(s)
		if err != nil {
			t.Errorf("HostSources returned %s: %v", s, err)
			continue
		}
		if !filepath.IsAbs(s) || !fi.Mode().IsRegular() {
			t.Errorf("HostSources returned %s, not an absolute regular file", s)
		}
		if s == "/etc/apt/sources.list" && fi.Size() == 0 {
			t.Errorf("HostSources returned the empty %s", s)
		}
		if s != "/etc/apt/sources.list" && !strings.HasSuffix(s, ".list") && !strings.HasSuffix(s, ".sources") {
			t.Errorf("HostSources returned %s, not a source file", s)
		}
	}
}

func TestRemoveTree(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "work")
	writeTestFile(t, filepath.Join(dir, "root/etc/passwd"), "root:x:0:0::/root:/bin/sh\n", 0o644)
	writeTestFile(t, filepath.Join(dir, "root/usr/bin/x"), "", 0o755)
	removeTree(discard(), dir)
	if _, err := os.Lstat(dir); !os.IsNotExist(err) {
		t.Errorf("tree still there: %v", err)
	}
	removeTree(discard(), dir) // gone already: nothing to do
}

// bindMount binds src at dst, skipping the test where mounts are not
// allowed, and undoes it at the end of the test if it is still there.
func bindMount(t *testing.T, src, dst string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to bind-mount")
	}
	if err := unix.Mount(src, dst, "", unix.MS_BIND, ""); err != nil {
		t.Skipf("cannot bind-mount here: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dst, unix.MNT_DETACH) })
}

// mountinfoEscape escapes a path as /proc/self/mountinfo does.
var mountinfoEscape = strings.NewReplacer(`\\`, `\134`, " ", `\040`, "\t", `\011`, "\n", `\012`)

func mountedUnder(t *testing.T, dir string) []string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], mountinfoEscape.Replace(dir)) {
			out = append(out, f[4])
		}
	}
	return out
}

// TestRemoveTreeMounts checks that removeTree detaches what is mounted in
// the tree (nested mounts too) before removing it, so that the removal
// does not reach the mounts' sources.
func TestRemoveTreeMounts(t *testing.T) {
	for _, how := range []string{"absolute", "relative", "through a link", "with a space"} {
		t.Run(how, func(t *testing.T) {
			parent, err := filepath.EvalSymlinks(t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			dir := filepath.Join(parent, "work")
			if how == "with a space" {
				dir = filepath.Join(parent, "work tree\tx")
			}
			src := t.TempDir()
			writeTestFile(t, filepath.Join(src, "keep"), "host file\n", 0o644)
			inner := t.TempDir()
			writeTestFile(t, filepath.Join(inner, "keep"), "inner host file\n", 0o644)
			if err := os.MkdirAll(filepath.Join(dir, "root/dev"), 0o755); err != nil {
				t.Fatal(err)
			}
			writeTestFile(t, filepath.Join(dir, "root/etc/passwd"), "", 0o644)
			bindMount(t, src, filepath.Join(dir, "root/dev"))
			if err := os.MkdirAll(filepath.Join(dir, "root/dev/pts"), 0o755); err != nil {
				t.Fatal(err)
			}
			bindMount(t, inner, filepath.Join(dir, "root/dev/pts"))
			if m := mountedUnder(t, dir); len(m) != 2 {
				t.Fatalf("mounts under the tree: %v, want 2", m)
			}

			arg := dir
			switch how {
			case "relative":
				t.Chdir(parent)
				arg = "work"
			case "through a link":
				link := filepath.Join(t.TempDir(), "link")
				mustSymlink(t, parent, link)
				arg = filepath.Join(link, "work")
			}
			removeTree(discard(), arg)

			if m := mountedUnder(t, dir); len(m) != 0 {
				t.Errorf("still mounted under the tree: %v", m)
			}
			if _, err := os.Lstat(dir); !os.IsNotExist(err) {
				t.Errorf("tree still there: %v", err)
			}
			if got := readTestFile(t, filepath.Join(src, "keep")); got != "host file\n" {
				t.Errorf("bind source's file = %q", got)
			}
			if got := readTestFile(t, filepath.Join(inner, "keep")); got != "inner host file\n" {
				t.Errorf("inner bind source's file = %q", got)
			}
		})
	}
}

func TestBuildRequiresOptions(t *testing.T) {
	spec := validSpec()
	for name, o := range map[string]func(o *Options){
		"nil spec":        func(o *Options) { o.Spec = nil },
		"no cache dir":    func(o *Options) { o.CacheDir = "" },
		"no out dir":      func(o *Options) { o.OutDir = "" },
		"no agent binary": func(o *Options) { o.AgentBinary = "" },
		"invalid spec": func(o *Options) {
			s := *spec
			s.Packages = []string{"vim; rm -rf /"}
			o.Spec = &s
		},
	} {
		t.Run(name, func(t *testing.T) {
			base := t.TempDir()
			opts := Options{
				Spec:        spec,
				CacheDir:    filepath.Join(base, "cache"),
				OutDir:      filepath.Join(base, "out"),
				AgentBinary: filepath.Join(base, "carrel-agent"),
				Sources:     []string{filepath.Join(base, "sources.list")},
				Logger:      discard(),
			}
			o(&opts)
			res, err := Build(context.Background(), opts)
			if err == nil || res != nil {
				t.Fatalf("Build = %v, %v; want an error", res, err)
			}
			if name == "invalid spec" && !errors.Is(err, ErrInvalidSpec) {
				t.Errorf("error %q does not wrap ErrInvalidSpec", err)
			}
			if ents, _ := os.ReadDir(base); len(ents) != 0 {
				t.Errorf("Build left %v behind", ents)
			}
		})
	}
}
