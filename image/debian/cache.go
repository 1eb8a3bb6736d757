package debian

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/carrel-os/carrel/image/imagedir"
)

// cacheVersion changes whenever the build itself changes what it makes.
const cacheVersion = "carrel-debian-1"

// CacheKey names a build by its inputs: the spec, carrel-agent, the apt
// sources, the host's apt indices (which decide the kernel's version), and
// the tools that write the root. mmdebstrap fetches the mirror's indices
// afresh, so a mirror that moved on since the host's last `apt-get update`
// is not seen until that update changes the key, or a build runs with
// --no-cache: like a container build cache, a hit is the image the same
// inputs made before.
func CacheKey(ctx context.Context, s *Spec, agentBinary string, sources []string) (string, error) {
	h := sha256.New()
	fmt.Fprintf(h, "%s\x00%s\x00", cacheVersion, s.Canonical())
	files := []string{agentBinary}
	files = append(files, sources...)
	lists, _ := filepath.Glob("/var/lib/apt/lists/*Release")
	files = append(files, lists...)
	for _, f := range files {
		if err := hashInto(h, f); err != nil {
			return "", fmt.Errorf("cache key: %w", err)
		}
	}
	tools, _ := exec.CommandContext(ctx, "dpkg-query", "-W", "erofs-utils", "mmdebstrap", "dpkg").Output()
	h.Write(tools)
	return hex.EncodeToString(h.Sum(nil)), nil
}

func hashInto(h io.Writer, path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	fmt.Fprintf(h, "%s\x00", path)
	_, err = io.Copy(h, f)
	return err
}

// maxCachedImages bounds the cache of built images: each is a whole image
// (hundreds of MiB for the agent image).
const maxCachedImages = 2

// staleBuild is how old a build directory left by a crashed build must be
// before Keep removes it; far longer than any build.
const staleBuild = 24 * time.Hour

func imagesDir(cacheDir string) string { return filepath.Join(cacheDir, "debian", "images") }

func validKey(key string) bool {
	if len(key) != 64 {
		return false
	}
	_, err := hex.DecodeString(key)
	return err == nil && strings.ToLower(key) == key
}

// Cached returns the image directory that the build with this key left in
// the cache, or "" when there is none that reads as an image. The caller
// imports it, which checks it again in full.
func Cached(cacheDir, key string) string {
	if !validKey(key) {
		return ""
	}
	dir := filepath.Join(imagesDir(cacheDir), key)
	if _, err := imagedir.Read(dir); err != nil {
		return ""
	}
	return dir
}

// NewBuildDir makes a directory in the cache for a build to write its
// image into (at OutDir = NewBuildDir/image), so that Keep can rename the
// result into place. The caller removes it when done.
func NewBuildDir(cacheDir string) (string, error) {
	if err := os.MkdirAll(imagesDir(cacheDir), 0o755); err != nil {
		return "", err
	}
	return os.MkdirTemp(imagesDir(cacheDir), ".build-")
}

// Keep moves the image directory built into the cache under key,
// replacing an older one of the same key, and keeps only the newest
// maxCachedImages images (and no build directory older than a day). It
// returns the image's directory in the cache.
func Keep(cacheDir, key, built string) (string, error) {
	if !validKey(key) {
		return "", fmt.Errorf("cache key %q: want 64 lower-case hex digits", key)
	}
	root := imagesDir(cacheDir)
	dst := filepath.Join(root, key)
	if err := os.RemoveAll(dst); err != nil {
		return "", err
	}
	if err := os.Rename(built, dst); err != nil {
		return "", fmt.Errorf("keep the built image: %w", err)
	}
	now := time.Now()
	if err := os.Chtimes(dst, now, now); err != nil {
		return "", err
	}
	ents, err := os.ReadDir(root)
	if err != nil {
		return dst, nil
	}
	type entry struct {
		name string
		mod  time.Time
	}
	var images []entry
	for _, e := range ents {
		info, err := e.Info()
		if err != nil || !e.IsDir() {
			continue
		}
		switch {
		case strings.HasPrefix(e.Name(), ".build-"):
			if now.Sub(info.ModTime()) > staleBuild {
				os.RemoveAll(filepath.Join(root, e.Name()))
			}
		case validKey(e.Name()) && e.Name() != key:
			images = append(images, entry{e.Name(), info.ModTime()})
		}
	}
	slices.SortFunc(images, func(a, b entry) int { return b.mod.Compare(a.mod) })
	for i, e := range images {
		if i+1 >= maxCachedImages { // the one just kept counts too
			os.RemoveAll(filepath.Join(root, e.name))
		}
	}
	return dst, nil
}
