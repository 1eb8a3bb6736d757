// Package debian builds images in carrel's format from Debian packages, on
// any Debian host: mmdebstrap installs a spec's packages from the apt
// sources the host already uses, the builder adds the spec's users, files
// and environment and points every network tool at carrel-agent's egress
// proxy, then normalizes what would differ from one build to the next.
// image/devimage then adds the kernel and carrel-agent's initramfs and
// seals the tree as the verified root (erofs under dm-verity).
//
// The same spec and the same package versions give a byte-identical root
// and so the same root hash: timestamps come from SOURCE_DATE_EPOCH, and
// logs, caches and other run-dependent files are removed. Downloaded
// packages are kept in the cache directory for the next build, and a
// build whose inputs have not changed is not run again (CacheKey).
package debian

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/image/devimage"
	"github.com/carrel-os/carrel/image/manifest"
)

// Epoch is the SOURCE_DATE_EPOCH of every build: every file of the root
// has this time (2024-01-01T00:00:00Z), so it says nothing of when the
// image was built.
const Epoch = 1704067200

// Options configures Build.
type Options struct {
	Spec *Spec
	// CacheDir holds downloaded packages between builds (the kernel's,
	// as image/devimage keeps them, and apt's archives for mmdebstrap).
	CacheDir string
	// OutDir receives the image directory (image/imagedir).
	OutDir string
	// AgentBinary is the static carrel-agent, the initramfs's /init.
	AgentBinary string
	// Sources are apt source files (one-line or deb822); nil means the
	// host's own (/etc/apt/sources.list and sources.list.d).
	Sources []string
	Logger  *slog.Logger
}

// Build builds the spec's image into o.OutDir.
func Build(ctx context.Context, o Options) (*devimage.Result, error) {
	if o.Spec == nil || o.CacheDir == "" || o.OutDir == "" || o.AgentBinary == "" {
		return nil, errors.New("build debian image: spec, cache dir, output dir and agent binary are required")
	}
	if err := o.Spec.Validate(); err != nil {
		return nil, err
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	log := o.Logger.With("subsystem", "debian", "image", o.Spec.Name)
	if o.Sources == nil {
		var err error
		if o.Sources, err = HostSources(); err != nil {
			return nil, fmt.Errorf("build debian image: %w", err)
		}
	}
	if err := os.MkdirAll(o.OutDir, 0o755); err != nil {
		return nil, fmt.Errorf("build debian image: %w", err)
	}
	work, err := os.MkdirTemp(filepath.Dir(filepath.Clean(o.OutDir)), ".debian-")
	if err != nil {
		return nil, fmt.Errorf("build debian image: %w", err)
	}
	defer removeTree(log, work)
	tree := filepath.Join(work, "root")

	start := time.Now()
	if err := mmdebstrap(ctx, log, o, tree); err != nil {
		return nil, fmt.Errorf("build debian image: %w", err)
	}
	log.Info("packages installed", "took", time.Since(start).Round(time.Second))
	if err := configure(tree, o.Spec); err != nil {
		return nil, fmt.Errorf("build debian image: configure: %w", err)
	}
	if o.Spec.Init == InitSystemd {
		if err := installAgentService(tree, o.AgentBinary); err != nil {
			return nil, fmt.Errorf("build debian image: carrel-agent service: %w", err)
		}
	}
	pkgs, err := installed(ctx, tree)
	if err != nil {
		return nil, fmt.Errorf("build debian image: %w", err)
	}
	if err := normalize(tree); err != nil {
		return nil, fmt.Errorf("build debian image: normalize: %w", err)
	}
	res, err := devimage.Build(ctx, devimage.Options{
		CacheDir:       o.CacheDir,
		OutDir:         o.OutDir,
		AgentBinary:    o.AgentBinary,
		Name:           o.Spec.Name,
		Cmdline:        o.Spec.cmdline(),
		RootTree:       tree,
		RootPackages:   pkgs,
		RootCompressor: o.Spec.Compression,
		Logger:         o.Logger,
	})
	if err != nil {
		return nil, fmt.Errorf("build debian image: %w", err)
	}
	log.Info("debian image built", "packages", len(pkgs), "root_bytes", res.Manifest.System.Size,
		"root_hash", res.Manifest.Verity.RootHash, "took", time.Since(start).Round(time.Second))
	return res, nil
}

// HostSources are the host's apt source files.
func HostSources() ([]string, error) {
	var out []string
	if fi, err := os.Stat("/etc/apt/sources.list"); err == nil && fi.Size() > 0 {
		out = append(out, "/etc/apt/sources.list")
	}
	for _, pat := range []string{"/etc/apt/sources.list.d/*.list", "/etc/apt/sources.list.d/*.sources"} {
		m, _ := filepath.Glob(pat)
		out = append(out, m...)
	}
	if len(out) == 0 {
		return nil, errors.New("the host has no apt sources (/etc/apt/sources.list, sources.list.d): give the builder some")
	}
	slices.Sort(out)
	return out, nil
}

// hostAptOptions are the host's settings that decide whether its mirrors
// can be reached and trusted as the host reaches them (a proxy, a snapshot
// mirror's expired Release file), for mmdebstrap's apt.
func hostAptOptions(ctx context.Context) []string {
	out, err := exec.CommandContext(ctx, "apt-config", "dump").Output()
	if err != nil {
		return nil
	}
	keep := map[string]bool{
		"Acquire::Check-Valid-Until": true, "Acquire::Check-Date": true,
		"Acquire::http::Proxy": true, "Acquire::https::Proxy": true, "Acquire::Retries": true,
	}
	var opts []string
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), " ")
		if ok && keep[k] {
			opts = append(opts, k+" "+strings.TrimSuffix(v, ";"))
		}
	}
	return opts
}

// dpkgExcludes keep documentation out of the image (but each package's
// copyright, which its licence may require).
var dpkgExcludes = []string{
	"path-exclude=/usr/share/doc/*",
	"path-include=/usr/share/doc/*/copyright",
	"path-exclude=/usr/share/man/*",
	"path-exclude=/usr/share/info/*",
	"path-exclude=/usr/share/lintian/*",
	"path-exclude=/usr/share/locale/*",
}

func mmdebstrap(ctx context.Context, log *slog.Logger, o Options, tree string) error {
	archives := filepath.Join(o.CacheDir, "debian", "archives")
	if err := os.MkdirAll(archives, 0o755); err != nil {
		return err
	}
	args := []string{
		"--mode=root", "--variant=apt", "--format=directory",
		"--include=" + strings.Join(o.Spec.installPackages(), ","),
		// Keep the archives of the essential packages too, and copy every
		// archive in from the cache and back out to it.
		"--skip=essential/unlink",
		"--setup-hook=mkdir -p \"$1\"/var/cache/apt/archives/",
		"--setup-hook=sync-in " + archives + " /var/cache/apt/archives/",
		"--customize-hook=sync-out /var/cache/apt/archives " + archives,
	}
	for _, opt := range hostAptOptions(ctx) {
		args = append(args, "--aptopt="+opt)
	}
	for _, x := range dpkgExcludes {
		args = append(args, "--dpkgopt="+x)
	}
	args = append(args, o.Spec.Suite, tree)
	args = append(args, o.Sources...)
	cmd := exec.CommandContext(ctx, "mmdebstrap", args...)
	cmd.Env = append(os.Environ(), "SOURCE_DATE_EPOCH="+strconv.Itoa(Epoch), "LC_ALL=C.UTF-8", "DEBIAN_FRONTEND=noninteractive")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	cmd.Stdout = &stderr
	log.Info("installing packages with mmdebstrap", "suite", o.Spec.Suite, "packages", len(o.Spec.Packages))
	if err := cmd.Run(); err != nil {
		var ee *exec.Error
		if errors.As(err, &ee) {
			return fmt.Errorf("mmdebstrap: %w (install the mmdebstrap package)", err)
		}
		return fmt.Errorf("mmdebstrap: %w:\n%s", err, lastLines(stderr.String(), 15))
	}
	return nil
}

// installed lists the packages dpkg installed in tree.
func installed(ctx context.Context, tree string) ([]manifest.Package, error) {
	out, err := exec.CommandContext(ctx, "dpkg-query", "--admindir="+filepath.Join(tree, "var/lib/dpkg"),
		"-W", "-f", "${db:Status-Abbrev}\t${Package}\t${Version}\t${Architecture}\n").Output()
	if err != nil {
		return nil, fmt.Errorf("list the image's packages: %w", err)
	}
	var pkgs []manifest.Package
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Split(line, "\t")
		if len(f) != 4 || !strings.HasPrefix(f[0], "ii") {
			continue
		}
		pkgs = append(pkgs, manifest.Package{Name: f[1], Version: f[2], Arch: f[3]})
	}
	if len(pkgs) == 0 {
		return nil, errors.New("list the image's packages: dpkg knows of none")
	}
	return manifest.SortPackages(pkgs), nil
}

// removeTree removes a build tree, first detaching anything still mounted
// below it (a build that died inside mmdebstrap), so that the removal
// cannot reach through a mount into the host.
func removeTree(log *slog.Logger, dir string) {
	// The mount table has absolute paths with no links in them.
	if abs, err := filepath.Abs(dir); err == nil {
		dir = abs
	}
	if real, err := filepath.EvalSymlinks(dir); err == nil {
		dir = real
	}
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		log.Error("build tree left in place: cannot read the mount table", "dir", dir, "err", err)
		return
	}
	var under []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) <= 4 {
			continue
		}
		if m := mountinfoUnescape.Replace(f[4]); m == dir || strings.HasPrefix(m, dir+"/") {
			under = append(under, m)
		}
	}
	slices.SortFunc(under, func(a, b string) int { return len(b) - len(a) }) // deepest first
	for _, m := range under {
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil {
			log.Error("build tree left in place: a mount below it cannot be detached", "mount", m, "err", err)
			return
		}
	}
	if err := os.RemoveAll(dir); err != nil {
		log.Warn("remove build tree", "dir", dir, "err", err)
	}
}

// mountinfoUnescape undoes the kernel's escapes of a mount point in
// /proc/self/mountinfo.
var mountinfoUnescape = strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`)

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
