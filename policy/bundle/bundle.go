// Package bundle is a policy's source: Rego modules and one data
// document, checked, named by revision, read from a directory or built in.
// It does not import the policy engine (OPA), so a program that only reads
// or sends bundles (the carrel CLI) does not link it; policy.Compile makes
// a bundle a policy.
package bundle

import (
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/carrel-os/carrel/policy/examples"
)

// Caps on a bundle, so that a bundle handed to carreld cannot exhaust it.
const (
	MaxFiles = 256
	MaxBytes = 4 << 20
)

// DataFile is the one data document a bundle may carry, at its root.
const DataFile = "data.json"

// Names of the built-in policies: the default bundle and the examples,
// which are data only and layered on the default rules.
const DefaultName = "default"

// The default rules and data are the .rego files and data.json beside
// this file.
//
//go:embed *.rego data.json
var defaultFS embed.FS

// A Bundle is a policy's source: Rego modules and one data document,
// keyed by slash-separated path. It is inert until Compile.
type Bundle struct {
	Files map[string][]byte
	// Revision is the sha256 of every path and content, in path order:
	// the same files always give the same revision.
	Revision string
}

// New checks files and computes the revision. Only .rego files and a
// root data.json are allowed; paths must be clean and relative.
func New(files map[string][]byte) (*Bundle, error) {
	if len(files) == 0 {
		return nil, fmt.Errorf("%w: no files", ErrInvalid)
	}
	if len(files) > MaxFiles {
		return nil, fmt.Errorf("%w: %d files, limit %d", ErrInvalid, len(files), MaxFiles)
	}
	total := 0
	names := make([]string, 0, len(files))
	for p, b := range files {
		total += len(b)
		if !fs.ValidPath(p) || p == "." {
			return nil, fmt.Errorf("%w: bad file path %q", ErrInvalid, p)
		}
		if !strings.HasSuffix(p, ".rego") && p != DataFile {
			return nil, fmt.Errorf("%w: %s: only .rego files and a root %s belong in a bundle", ErrInvalid, p, DataFile)
		}
		if !utf8.Valid(b) {
			return nil, fmt.Errorf("%w: %s is not UTF-8", ErrInvalid, p)
		}
		names = append(names, p)
	}
	if total > MaxBytes {
		return nil, fmt.Errorf("%w: %d bytes, limit %d", ErrInvalid, total, MaxBytes)
	}
	slices.Sort(names)
	h := sha256.New()
	for _, p := range names {
		fmt.Fprintf(h, "%d:%s%d:", len(p), p, len(files[p]))
		h.Write(files[p])
	}
	return &Bundle{Files: files, Revision: "sha256:" + hex.EncodeToString(h.Sum(nil))}, nil
}

// FromFiles makes a bundle from files sent over the API: a set without
// rules is layered on the default rules, as LoadDir does.
func FromFiles(files map[string][]byte) (*Bundle, error) {
	if len(files) > MaxFiles {
		return nil, fmt.Errorf("%w: %d files, limit %d", ErrInvalid, len(files), MaxFiles)
	}
	cp := make(map[string][]byte, len(files))
	for p, b := range files {
		cp[p] = b
	}
	return withDefaultRules(cp)
}

// LoadDir reads a bundle from a directory. A directory with no .rego files
// is a data-only policy: its data.json is layered on the default rules.
func LoadDir(dir string) (*Bundle, error) {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, fmt.Errorf("load policy %s: %w", dir, err)
	}
	defer root.Close()
	files, err := readFS(root.FS(), ".")
	if err != nil {
		return nil, fmt.Errorf("load policy %s: %w", dir, err)
	}
	return withDefaultRules(files)
}

// readFS collects the .rego files and the root data.json under dir of
// fsys. Other files are ignored (a README beside the rules is fine);
// symlinks are not followed.
func readFS(fsys fs.FS, dir string) (map[string][]byte, error) {
	files := map[string][]byte{}
	total := 0
	err := fs.WalkDir(fsys, dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel := strings.TrimPrefix(strings.TrimPrefix(p, dir), "/")
		if d.IsDir() || !d.Type().IsRegular() {
			return nil
		}
		if !strings.HasSuffix(rel, ".rego") && rel != DataFile {
			return nil
		}
		if len(files) >= MaxFiles {
			return fmt.Errorf("%w: more than %d files", ErrInvalid, MaxFiles)
		}
		b, err := fs.ReadFile(fsys, p)
		if err != nil {
			return err
		}
		if total += len(b); total > MaxBytes {
			return fmt.Errorf("%w: more than %d bytes", ErrInvalid, MaxBytes)
		}
		files[rel] = b
		return nil
	})
	return files, err
}

// withDefaultRules completes a file set without rules (data, perhaps with
// tests of its own) with the default rules.
func withDefaultRules(files map[string][]byte) (*Bundle, error) {
	hasRules := false
	for p := range files {
		if strings.HasSuffix(p, ".rego") && !strings.HasSuffix(p, "_test.rego") {
			hasRules = true
		}
	}
	if !hasRules {
		rules, err := readFS(defaultFS, ".")
		if err != nil {
			return nil, err
		}
		// The default tests test the default data: a set with data of its
		// own gets the rules only, and brings its own tests.
		_, ownData := files[DataFile]
		for p, b := range rules {
			if ownData && (p == DataFile || strings.HasSuffix(p, "_test.rego")) {
				continue
			}
			if _, ok := files[p]; !ok {
				files[p] = b
			}
		}
	}
	return New(files)
}

// Builtin returns a built-in policy by name: "default", or one of the
// examples under policy/examples.
func Builtin(name string) (*Bundle, error) {
	if name == DefaultName {
		files, err := readFS(defaultFS, ".")
		if err != nil {
			return nil, err
		}
		return New(files)
	}
	if !slices.Contains(BuiltinNames(), name) {
		return nil, fmt.Errorf("%w: %q", ErrNoSuchPolicy, name)
	}
	files, err := readFS(examples.FS, name)
	if err != nil {
		return nil, err
	}
	return withDefaultRules(files)
}

// BuiltinNames lists the built-in policies, the default first.
func BuiltinNames() []string {
	names := []string{DefaultName}
	entries, _ := examples.FS.ReadDir(".")
	for _, e := range entries {
		if e.IsDir() {
			names = append(names, e.Name())
		}
	}
	return names
}

// WriteDir writes the bundle's files under dir, which must not exist yet.
func (b *Bundle) WriteDir(dir string) error {
	if err := os.Mkdir(dir, 0o755); err != nil {
		return err
	}
	for p, data := range b.Files {
		full := filepath.Join(dir, filepath.FromSlash(p))
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(full, data, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// Errors callers branch on.
var (
	ErrInvalid      = errors.New("invalid policy bundle")
	ErrNoSuchPolicy = errors.New("no such policy")
)

// Load reads the bundle arg names: a directory, or else a built-in policy.
func Load(arg string) (*Bundle, error) {
	if fi, err := os.Stat(arg); err == nil && fi.IsDir() {
		return LoadDir(arg)
	}
	if slices.Contains(BuiltinNames(), arg) {
		return Builtin(arg)
	}
	return nil, fmt.Errorf("%s is neither a directory nor a built-in policy (%s)", arg, strings.Join(BuiltinNames(), ", "))
}
