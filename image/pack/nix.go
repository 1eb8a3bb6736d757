package pack

import (
	"bufio"
	"fmt"
	"io"
	"strings"

	"github.com/carrel-os/carrel/image/manifest"
)

// NixStoreDir is where Nix store paths live.
const NixStoreDir = "/nix/store/"

// maxClosurePaths bounds a closure's store-path list.
const maxClosurePaths = 1 << 16

// NixPackages reads a closure's store paths, one per line (the store-paths
// file of nixpkgs' closureInfo), and returns the packages they hold: each
// path's name split into name and version as Nix's parseDrvName splits it
// (the version starts after the first dash that is followed by something
// other than a letter). Paths of several outputs of one package give it
// once; a path without a version is listed with an empty one.
func NixPackages(r io.Reader) ([]manifest.Package, error) {
	sc := bufio.NewScanner(r)
	var out []manifest.Package
	n := 0
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		n++
		if n > maxClosurePaths {
			return nil, fmt.Errorf("closure: more than %d store paths", maxClosurePaths)
		}
		base, ok := strings.CutPrefix(line, NixStoreDir)
		if !ok || strings.Contains(base, "/") {
			return nil, fmt.Errorf("closure: %q is not a store path (%sHASH-NAME)", line, NixStoreDir)
		}
		// A store path's base name is a 32-character hash, a dash and
		// the name.
		if len(base) < 34 || base[32] != '-' {
			return nil, fmt.Errorf("closure: %q is not a store path (%sHASH-NAME)", line, NixStoreDir)
		}
		name, version := ParseDrvName(base[33:])
		out = append(out, manifest.Package{Name: name, Version: version})
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("closure: %w", err)
	}
	return manifest.SortPackages(out), nil
}

// ParseDrvName splits a Nix package name into name and version as Nix's
// builtins.parseDrvName does: "hello-2.12.1" is "hello" and "2.12.1",
// "python3.12-numpy-2.1" is "python3.12-numpy" and "2.1", and a name with
// no dash before a non-letter has no version.
func ParseDrvName(s string) (name, version string) {
	for i := 0; i+1 < len(s); i++ {
		if s[i] == '-' && !isLetter(s[i+1]) {
			return s[:i], s[i+1:]
		}
	}
	return s, ""
}

func isLetter(c byte) bool { return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }
