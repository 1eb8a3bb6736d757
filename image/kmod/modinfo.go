// Package kmod finds Linux kernel modules in an unpacked module tree
// (lib/modules/<release>) and computes the load order for a set of them
// from each module's own .modinfo section, so it needs no modules.dep.
package kmod

import (
	"bytes"
	"compress/gzip"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/ulikunitz/xz"
)

// MaxModuleSize bounds a module's (decompressed) size; no real module comes
// near it.
const MaxModuleSize = 64 << 20

// ErrUnsupportedCompression is returned for module files compressed with a
// format this package cannot read (zstd).
var ErrUnsupportedCompression = errors.New("unsupported module compression")

// Modinfo holds a module's .modinfo entries; a key may repeat (alias, parm).
type Modinfo map[string][]string

// Get returns the first value of key, or "".
func (mi Modinfo) Get(key string) string {
	if v := mi[key]; len(v) > 0 {
		return v[0]
	}
	return ""
}

// ParseModinfo reads the .modinfo section of an ELF module image: NUL
// separated key=value strings.
func ParseModinfo(image []byte) (Modinfo, error) {
	f, err := elf.NewFile(bytes.NewReader(image))
	if err != nil {
		return nil, fmt.Errorf("parse module elf: %w", err)
	}
	defer f.Close()
	sec := f.Section(".modinfo")
	if sec == nil {
		return nil, errors.New("module has no .modinfo section")
	}
	if sec.Size > uint64(len(image)) {
		return nil, errors.New("module .modinfo section exceeds file")
	}
	data, err := sec.Data()
	if err != nil {
		return nil, fmt.Errorf("read .modinfo: %w", err)
	}
	mi := Modinfo{}
	for _, kv := range bytes.Split(data, []byte{0}) {
		k, v, ok := strings.Cut(string(kv), "=")
		if !ok || k == "" {
			continue // alignment padding between entries
		}
		mi[k] = append(mi[k], v)
	}
	return mi, nil
}

// compressionSuffixes are the module file endings this package knows,
// mapped to whether it can decompress them.
var compressionSuffixes = map[string]bool{".xz": true, ".gz": true, ".zst": false}

// splitModuleFile returns the file's name without any compression suffix and
// that suffix; ok is false if it is not a module file.
func splitModuleFile(name string) (base, comp string, ok bool) {
	for suf := range compressionSuffixes {
		if b, found := strings.CutSuffix(name, ".ko"+suf); found {
			return b + ".ko", suf, true
		}
	}
	if strings.HasSuffix(name, ".ko") {
		return name, "", true
	}
	return "", "", false
}

// ReadFile returns the uncompressed content of the module file at path,
// which may end in .ko, .ko.xz or .ko.gz. A .ko.zst file gives an error
// wrapping ErrUnsupportedCompression.
func ReadFile(path string) ([]byte, error) {
	_, comp, ok := splitModuleFile(path)
	if !ok {
		return nil, fmt.Errorf("read module %s: not a .ko file", path)
	}
	if comp != "" && !compressionSuffixes[comp] {
		return nil, fmt.Errorf("read module %s: %w: %s (repack the tree with uncompressed or xz modules)", path, ErrUnsupportedCompression, comp)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("read module: %w", err)
	}
	defer f.Close()
	var r io.Reader = f
	size := 0 // the content's size, when known: an uncompressed module's
	switch comp {
	case ".xz":
		xr, err := xz.NewReader(f)
		if err != nil {
			return nil, fmt.Errorf("read module %s: xz: %w", path, err)
		}
		r = xr
	case ".gz":
		zr, err := gzip.NewReader(f)
		if err != nil {
			return nil, fmt.Errorf("read module %s: gzip: %w", path, err)
		}
		defer zr.Close()
		r = zr
	case "":
		if fi, err := f.Stat(); err == nil && fi.Size() <= MaxModuleSize {
			size = int(fi.Size())
		}
	}
	b, err := readAll(io.LimitReader(r, MaxModuleSize+1), size)
	if err != nil {
		return nil, fmt.Errorf("read module %s: %w", path, err)
	}
	if len(b) > MaxModuleSize {
		return nil, fmt.Errorf("read module %s: larger than %d bytes", path, MaxModuleSize)
	}
	return b, nil
}

// readAll is io.ReadAll into a buffer sized for size bytes, so that a
// module of known size is read with one allocation rather than a dozen
// growing ones (an image build reads each of its modules twice).
func readAll(r io.Reader, size int) ([]byte, error) {
	b := make([]byte, 0, size+1) // +1: EOF is seen without growing
	for {
		n, err := r.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if err == io.EOF {
			return b, nil
		}
		if err != nil {
			return b, err
		}
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)]
		}
	}
}

// Normalize returns the kernel's canonical form of a module name: the kernel
// treats '-' and '_' alike and reports names with '_'.
func Normalize(name string) string { return strings.ReplaceAll(name, "-", "_") }
