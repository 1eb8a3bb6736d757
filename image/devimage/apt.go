package devimage

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// runFunc runs argv in dir and returns its standard output; a failure's
// error carries the command's standard error.
type runFunc func(ctx context.Context, dir string, argv ...string) ([]byte, error)

func execRun(ctx context.Context, dir string, argv ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "LC_ALL=C", "DEBIAN_FRONTEND=noninteractive")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		msg := strings.TrimSpace(stderr.String())
		if msg == "" {
			msg = strings.TrimSpace(stdout.String())
		}
		return stdout.Bytes(), fmt.Errorf("%s: %w: %s", strings.Join(argv, " "), err, msg)
	}
	return stdout.Bytes(), nil
}

// debPackage is the candidate version of a package as apt-cache reports it.
type debPackage struct {
	Name, Version, Arch, SHA256 string
	// Depends holds the first alternative of each dependency, name only.
	Depends []string
}

// fileName is apt's own name for the package's .deb, with the epoch's
// colon escaped.
func (p debPackage) fileName() string {
	return fmt.Sprintf("%s_%s_%s.deb", p.Name, strings.ReplaceAll(p.Version, ":", "%3a"), p.Arch)
}

// parseAptShow reads the stanzas of `apt-cache show` output.
func parseAptShow(out []byte) ([]debPackage, error) {
	var pkgs []debPackage
	var p debPackage
	flush := func() error {
		if p.Name == "" && p.Version == "" {
			return nil
		}
		if p.Name == "" || p.Version == "" || p.Arch == "" {
			return fmt.Errorf("parse apt-cache output: incomplete stanza for %q", p.Name)
		}
		pkgs = append(pkgs, p)
		p = debPackage{}
		return nil
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			if err := flush(); err != nil {
				return nil, err
			}
			continue
		}
		if line[0] == ' ' || line[0] == '\t' {
			continue // continuation of a multi-line field
		}
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		v = strings.TrimSpace(v)
		switch k {
		case "Package":
			p.Name = v
		case "Version":
			p.Version = v
		case "Architecture":
			p.Arch = v
		case "SHA256":
			p.SHA256 = v
		case "Depends", "Pre-Depends":
			p.Depends = append(p.Depends, parseDepends(v)...)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("parse apt-cache output: %w", err)
	}
	if err := flush(); err != nil {
		return nil, err
	}
	return pkgs, nil
}

// parseDepends turns "a (>= 1), b:any | c" into [a b].
func parseDepends(v string) []string {
	var out []string
	for _, group := range strings.Split(v, ",") {
		alt, _, _ := strings.Cut(group, "|")
		name := strings.Fields(alt)
		if len(name) == 0 {
			continue
		}
		n, _, _ := strings.Cut(name[0], ":")
		n, _, _ = strings.Cut(n, "(")
		if n != "" {
			out = append(out, n)
		}
	}
	return out
}

// fetcher downloads and unpacks Debian packages into a cache directory:
//
//	debs/<apt file name>.deb      downloaded packages
//	trees/<apt file name>/        each unpacked with dpkg-deb -x
//
// Both are renamed into place only when complete, so an interrupted build
// leaves nothing half-done that a later build would trust.
type fetcher struct {
	dir     string
	log     *slog.Logger
	run     runFunc
	updated bool // apt-get update ran in this build
}

func newFetcher(dir string, log *slog.Logger, run runFunc) (*fetcher, error) {
	for _, d := range []string{"debs", "trees"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return nil, fmt.Errorf("create cache: %w", err)
		}
		removeStale(filepath.Join(dir, d), time.Now().Add(-staleTemp))
	}
	return &fetcher{dir: dir, log: log, run: run}, nil
}

// staleTemp is how old a leftover temp directory of a killed build must be
// before it is removed; far longer than any build, so a concurrent build's
// work is never touched.
const staleTemp = 24 * time.Hour

// removeStale is best effort: leftovers only waste space.
func removeStale(dir string, before time.Time) {
	des, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, de := range des {
		if !strings.HasPrefix(de.Name(), ".") {
			continue
		}
		if fi, err := de.Info(); err == nil && fi.ModTime().Before(before) {
			_ = os.RemoveAll(filepath.Join(dir, de.Name()))
		}
	}
}

// withUpdate runs f, and if it fails, runs apt-get update once per build
// and tries again: empty or stale package lists show up as "unable to
// locate package" or as a 404 for a superseded version.
func (f *fetcher) withUpdate(ctx context.Context, what string, fn func() error) error {
	err := fn()
	if err == nil || f.updated || ctx.Err() != nil {
		return err
	}
	f.log.Info("package lookup failed; running apt-get update and retrying", "package", what, "err", err)
	f.updated = true
	if _, uerr := f.run(ctx, f.dir, "apt-get", "update"); uerr != nil {
		return errors.Join(err, fmt.Errorf("apt-get update: %w", uerr))
	}
	return fn()
}

// show returns the candidate version of each named package.
func (f *fetcher) show(ctx context.Context, names ...string) (map[string]debPackage, error) {
	out, err := f.run(ctx, f.dir, append([]string{"apt-cache", "show", "--no-all-versions"}, names...)...)
	if err != nil {
		return nil, fmt.Errorf("look up packages: %w", err)
	}
	pkgs, err := parseAptShow(out)
	if err != nil {
		return nil, fmt.Errorf("look up packages: %w", err)
	}
	found := map[string]debPackage{}
	for _, p := range pkgs {
		if _, dup := found[p.Name]; !dup {
			found[p.Name] = p
		}
	}
	for _, n := range names {
		if _, ok := found[n]; !ok {
			return nil, fmt.Errorf("look up package %s: apt-cache does not list it", n)
		}
	}
	return found, nil
}

// fetched is a package whose unpacked tree is in the cache.
type fetched struct {
	pkg  debPackage
	deb  string // the cached .deb
	tree string // where it is unpacked
}

// fetch returns the unpacked trees of the kernel package kernelPkg and of
// each of others, in that order, downloading and unpacking only what the
// cache lacks. Kernel meta packages (such as linux-image-amd64, which only
// depends on a versioned linux-image-<release>) are followed to the package
// that holds the kernel.
func (f *fetcher) fetch(ctx context.Context, kernelPkg string, others ...string) ([]fetched, error) {
	var out []fetched
	err := f.withUpdate(ctx, kernelPkg, func() error {
		out = out[:0]
		pkgs, err := f.show(ctx, append([]string{kernelPkg}, others...)...)
		if err != nil {
			return err
		}
		kp, err := f.followMeta(ctx, pkgs[kernelPkg])
		if err != nil {
			return err
		}
		out = append(out, fetched{pkg: kp})
		for _, n := range others {
			out = append(out, fetched{pkg: pkgs[n]})
		}
		for i := range out {
			if out[i].deb, err = f.download(ctx, out[i].pkg); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	for i := range out {
		if out[i].tree, err = f.extract(ctx, out[i].deb); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func (f *fetcher) followMeta(ctx context.Context, p debPackage) (debPackage, error) {
	const maxHops = 4
	for range maxHops {
		next := ""
		for _, d := range p.Depends {
			if strings.HasPrefix(d, "linux-image-") {
				next = d
				break
			}
		}
		if next == "" {
			return p, nil
		}
		f.log.Debug("following kernel meta package", "package", p.Name, "depends", next)
		pkgs, err := f.show(ctx, next)
		if err != nil {
			return p, err
		}
		p = pkgs[next]
	}
	return p, fmt.Errorf("kernel package %s: more than %d levels of meta packages", p.Name, maxHops)
}

// download returns the cached .deb for p, fetching it if it is missing or
// does not match apt's recorded hash.
func (f *fetcher) download(ctx context.Context, p debPackage) (string, error) {
	dst := filepath.Join(f.dir, "debs", p.fileName())
	switch err := checkSHA256(dst, p.SHA256); {
	case err == nil:
		f.log.Debug("using cached package", "package", p.Name, "version", p.Version, "file", dst)
		return dst, nil
	case errors.Is(err, fs.ErrNotExist):
	default:
		f.log.Warn("cached package is damaged; downloading again", "file", dst, "err", err)
	}

	tmp, err := os.MkdirTemp(filepath.Join(f.dir, "debs"), ".download-")
	if err != nil {
		return "", fmt.Errorf("download %s: %w", p.Name, err)
	}
	defer os.RemoveAll(tmp)
	f.log.Info("downloading package", "package", p.Name, "version", p.Version, "arch", p.Arch)
	out, err := f.run(ctx, tmp, "apt-get", "download", p.Name+"="+p.Version)
	if err != nil {
		return "", fmt.Errorf("download %s %s: %w", p.Name, p.Version, err)
	}
	f.log.Debug("apt-get download", "output", strings.TrimSpace(string(out)))
	got, err := filepath.Glob(filepath.Join(tmp, "*.deb"))
	if err != nil || len(got) != 1 {
		return "", fmt.Errorf("download %s %s: want one .deb in %s, found %d", p.Name, p.Version, tmp, len(got))
	}
	if err := checkSHA256(got[0], p.SHA256); err != nil {
		return "", fmt.Errorf("download %s %s: %w", p.Name, p.Version, err)
	}
	if err := os.Rename(got[0], dst); err != nil {
		return "", fmt.Errorf("download %s: %w", p.Name, err)
	}
	if fi, err := os.Stat(dst); err == nil {
		f.log.Info("downloaded package", "package", p.Name, "version", p.Version, "bytes", fi.Size(), "file", dst)
	}
	return dst, nil
}

// checkSHA256 returns nil if path exists and, when want is set, hashes to it.
func checkSHA256(path, want string) error {
	fh, err := os.Open(path)
	if err != nil {
		return err
	}
	defer fh.Close()
	if want == "" {
		return nil
	}
	h := sha256.New()
	if _, err := io.Copy(h, fh); err != nil {
		return fmt.Errorf("hash %s: %w", path, err)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != want {
		return fmt.Errorf("%s has sha256 %s, apt expects %s", path, got, want)
	}
	return nil
}

// extract returns deb's unpacked tree, unpacking it first if the cache has
// none.
func (f *fetcher) extract(ctx context.Context, deb string) (string, error) {
	dst := filepath.Join(f.dir, "trees", strings.TrimSuffix(filepath.Base(deb), ".deb"))
	if fi, err := os.Stat(dst); err == nil && fi.IsDir() {
		return dst, nil
	}
	tmp, err := os.MkdirTemp(filepath.Join(f.dir, "trees"), ".extract-")
	if err != nil {
		return "", fmt.Errorf("extract %s: %w", deb, err)
	}
	defer os.RemoveAll(tmp) // empty after a successful rename
	f.log.Info("unpacking package", "file", filepath.Base(deb))
	if _, err := f.run(ctx, f.dir, "dpkg-deb", "-x", deb, tmp); err != nil {
		return "", fmt.Errorf("extract %s: %w", deb, err)
	}
	if err := os.Rename(tmp, dst); err != nil {
		// Another build may have unpacked the same package meanwhile.
		if fi, serr := os.Stat(dst); serr == nil && fi.IsDir() {
			return dst, nil
		}
		return "", fmt.Errorf("extract %s: %w", deb, err)
	}
	return dst, nil
}
