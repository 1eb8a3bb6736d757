package debian

import (
	"context"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/image/imagedir"
	"github.com/carrel-os/carrel/image/manifest"
)

func TestCacheKey(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	agent := filepath.Join(dir, "carrel-agent")
	writeTestFile(t, agent, "agent v1", 0o755)
	sources := []string{filepath.Join(dir, "a.list"), filepath.Join(dir, "b.sources")}
	writeTestFile(t, sources[0], "deb http://deb.debian.org/debian bookworm main\n", 0o644)
	writeTestFile(t, sources[1], "Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm\nComponents: main\n", 0o644)
	spec := validSpec()

	key := func() string {
		t.Helper()
		k, err := CacheKey(ctx, spec, agent, sources)
		if err != nil {
			t.Fatalf("CacheKey: %v", err)
		}
		if b, err := hex.DecodeString(k); err != nil || len(b) != 32 || strings.ToLower(k) != k {
			t.Fatalf("CacheKey = %q, want 64 lower-case hex digits", k)
		}
		return k
	}
	base := key()
	if again := key(); again != base {
		t.Fatalf("CacheKey not stable: %s then %s", base, again)
	}

	seen := map[string]string{base: "base"}
	changed := func(what string) {
		t.Helper()
		k := key()
		if prev, ok := seen[k]; ok {
			t.Errorf("CacheKey after %s is the key of %s", what, prev)
		}
		seen[k] = what
	}

	// The spec, but not the order of its packages.
	spec.Packages = append(spec.Packages, "git")
	changed("adding a package")
	spec.Packages = []string{"git", "coreutils", "bash"}
	if k := key(); seen[k] != "adding a package" {
		t.Errorf("CacheKey depends on the order of the packages")
	}
	spec.Env["X"] = "1"
	changed("adding an environment variable")

	writeTestFile(t, agent, "agent v2", 0o755)
	changed("changing the agent binary")

	writeTestFile(t, sources[1], "Types: deb\nURIs: http://deb.debian.org/debian\nSuites: trixie\nComponents: main\n", 0o644)
	changed("changing a sources file")

	if k, err := CacheKey(ctx, spec, agent, sources[:1]); err != nil {
		t.Fatal(err)
	} else if _, ok := seen[k]; ok {
		t.Errorf("CacheKey unchanged when a sources file is dropped")
	}
}

func TestCacheKeyMissingFile(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	agent := filepath.Join(dir, "carrel-agent")
	writeTestFile(t, agent, "agent", 0o755)
	if _, err := CacheKey(ctx, validSpec(), filepath.Join(dir, "missing"), nil); err == nil {
		t.Error("CacheKey with a missing agent binary succeeded")
	}
	if _, err := CacheKey(ctx, validSpec(), agent, []string{filepath.Join(dir, "missing.list")}); err == nil {
		t.Error("CacheKey with a missing sources file succeeded")
	}
}

func TestCache(t *testing.T) {
	cache := t.TempDir()
	key := strings.Repeat("ab", 32)
	if d := Cached(cache, key); d != "" {
		t.Errorf("Cached in an empty cache = %q", d)
	}
	// Three builds; the cache keeps the newest two.
	keys := []string{key, strings.Repeat("cd", 32), strings.Repeat("ef", 32)}
	for i, k := range keys {
		build, err := NewBuildDir(cache)
		if err != nil {
			t.Fatal(err)
		}
		out := filepath.Join(build, "image")
		writeImageDir(t, out, fmt.Sprintf("image%d", i))
		dir, err := Keep(cache, k, out)
		if err != nil {
			t.Fatalf("Keep: %v", err)
		}
		if got := Cached(cache, k); got != dir || dir != filepath.Join(cache, "debian", "images", k) {
			t.Errorf("Cached = %q, Keep = %q", got, dir)
		}
		os.RemoveAll(build)
		past := time.Now().Add(time.Duration(i-10) * time.Minute)
		os.Chtimes(dir, past, past)
	}
	if Cached(cache, keys[0]) != "" || Cached(cache, keys[1]) == "" || Cached(cache, keys[2]) == "" {
		t.Errorf("cache holds the wrong images: %v", listDir(t, filepath.Join(cache, "debian", "images")))
	}
	// A damaged entry is no entry; bad keys are refused.
	if err := os.WriteFile(filepath.Join(cache, "debian", "images", keys[2], "extra"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if d := Cached(cache, keys[2]); d != "" {
		t.Errorf("damaged entry: Cached = %q", d)
	}
	for _, bad := range []string{"", "../x", strings.Repeat("AB", 32), strings.Repeat("ab", 31)} {
		if d := Cached(cache, bad); d != "" {
			t.Errorf("Cached(%q) = %q", bad, d)
		}
		if _, err := Keep(cache, bad, t.TempDir()); err == nil {
			t.Errorf("Keep(%q) succeeded", bad)
		}
	}
}

// writeImageDir writes a small valid image directory (no verified root).
func writeImageDir(t *testing.T, dir, name string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	part := func(file, content string) manifest.Part {
		writeTestFile(t, filepath.Join(dir, file), content, 0o644)
		return manifest.Part{Digest: manifest.DigestBytes([]byte(content)), Size: int64(len(content))}
	}
	m := &manifest.Manifest{SchemaVersion: manifest.SchemaVersion, Name: name, Arch: "amd64", KernelVersion: "6.1.0",
		Kernel: part(imagedir.FileName(manifest.PartKernel), "kernel"), Initrd: part(imagedir.FileName(manifest.PartInitrd), "initrd"),
		Cmdline: "console=ttyS0"}
	b, err := m.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	writeTestFile(t, filepath.Join(dir, imagedir.ManifestFile), string(b), 0o644)
}

func listDir(t *testing.T, dir string) []string {
	ents, _ := os.ReadDir(dir)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return names
}
