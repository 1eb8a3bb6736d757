package kmod

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
)

// ErrUnknownModule means a module is neither in the tree nor built in.
var ErrUnknownModule = errors.New("unknown kernel module")

// Module is a loadable module found in a Tree.
type Module struct {
	// Name is the canonical module name (with '_', never '-').
	Name string
	// File is the module's host path; it may be compressed (see ReadFile).
	File string
	// Rel is the path of the uncompressed .ko relative to the tree root,
	// slash separated, e.g. "kernel/drivers/virtio/virtio.ko".
	Rel string
	// Depends lists the modules that must be loaded first, as the module's
	// .modinfo states them.
	Depends []string
}

// Tree is one kernel release's module directory, lib/modules/<release>.
// It caches what it reads and is not safe for concurrent use.
type Tree struct {
	root    string
	release string
	files   map[string]string // canonical name -> path relative to root
	builtin map[string]bool
	loaded  map[string]*Module
}

// searchRank orders where a module may live, as depmod's default search
// order does: updates and extra override the kernel's own.
func searchRank(rel string) int {
	switch {
	case strings.HasPrefix(rel, "updates/"):
		return 0
	case strings.HasPrefix(rel, "extra/"):
		return 1
	default:
		return 2
	}
}

// Open indexes the module tree at root, whose base name must be the kernel
// release (as in lib/modules/6.1.0-56-amd64). It reads file names and
// modules.builtin only; a module's .modinfo is read when it is needed.
func Open(root string) (*Tree, error) {
	t := &Tree{
		root:    root,
		release: filepath.Base(root),
		files:   map[string]string{},
		builtin: map[string]bool{},
		loaded:  map[string]*Module{},
	}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.Type().IsRegular() {
			return nil
		}
		base, _, ok := splitModuleFile(d.Name())
		if !ok {
			return nil
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		name := Normalize(strings.TrimSuffix(base, ".ko"))
		if prev, dup := t.files[name]; dup {
			switch {
			case searchRank(rel) < searchRank(prev):
			case searchRank(rel) > searchRank(prev):
				return nil
			default:
				return fmt.Errorf("module %s found twice: %s and %s", name, prev, rel)
			}
		}
		t.files[name] = rel
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("index modules in %s: %w", root, err)
	}
	if err := t.readBuiltin(); err != nil {
		return nil, err
	}
	return t, nil
}

func (t *Tree) readBuiltin() error {
	f, err := os.Open(filepath.Join(t.root, "modules.builtin"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read modules.builtin: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if base, _, ok := splitModuleFile(path.Base(strings.TrimSpace(sc.Text()))); ok {
			t.builtin[Normalize(strings.TrimSuffix(base, ".ko"))] = true
		}
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("read modules.builtin: %w", err)
	}
	return nil
}

// Release returns the kernel release the tree belongs to.
func (t *Tree) Release() string { return t.release }

// Builtin reports whether the kernel has module name built in, per
// modules.builtin; such a module needs no loading.
func (t *Tree) Builtin(name string) bool { return t.builtin[Normalize(name)] }

// Module returns the loadable module called name. It reads the module's
// .modinfo and checks that the module names itself name and was built for
// this tree's release. An absent module gives an error wrapping
// ErrUnknownModule.
func (t *Tree) Module(name string) (*Module, error) {
	name = Normalize(name)
	if m, ok := t.loaded[name]; ok {
		return m, nil
	}
	rel, ok := t.files[name]
	if !ok {
		return nil, fmt.Errorf("module %q: %w", name, ErrUnknownModule)
	}
	file := filepath.Join(t.root, filepath.FromSlash(rel))
	image, err := ReadFile(file)
	if err != nil {
		return nil, err
	}
	mi, err := ParseModinfo(image)
	if err != nil {
		return nil, fmt.Errorf("module %s: %w", rel, err)
	}
	if got := mi.Get("name"); got != "" && Normalize(got) != name {
		return nil, fmt.Errorf("module %s calls itself %q", rel, got)
	}
	if vm := strings.Fields(mi.Get("vermagic")); len(vm) == 0 || vm[0] != t.release {
		return nil, fmt.Errorf("module %s: vermagic %q does not match release %s", rel, mi.Get("vermagic"), t.release)
	}
	var deps []string
	for _, d := range strings.Split(mi.Get("depends"), ",") {
		if d = strings.TrimSpace(d); d != "" {
			deps = append(deps, Normalize(d))
		}
	}
	relKo, _, _ := splitModuleFile(rel)
	m := &Module{Name: name, File: file, Rel: relKo, Depends: deps}
	t.loaded[name] = m
	return m, nil
}

// Closure returns the modules named and everything they depend on, in an
// order they can be loaded: each module after all its dependencies. Built-in
// modules are left out. The order depends only on names and the tree, so it
// is reproducible. An unknown module or a dependency cycle is an error.
func (t *Tree) Closure(names ...string) ([]*Module, error) {
	const (
		visiting = 1
		done     = 2
	)
	state := map[string]int{}
	var order []*Module
	var visit func(name string, chain []string) error
	visit = func(name string, chain []string) error {
		name = Normalize(name)
		chain = append(slices.Clip(chain), name)
		switch state[name] {
		case done:
			return nil
		case visiting:
			return fmt.Errorf("module dependency cycle: %s", strings.Join(chain, " -> "))
		}
		if t.Builtin(name) {
			state[name] = done
			return nil
		}
		m, err := t.Module(name)
		if err != nil {
			if len(chain) > 1 {
				return fmt.Errorf("%s: %w", strings.Join(chain, " -> "), err)
			}
			return err
		}
		state[name] = visiting
		for _, d := range m.Depends {
			if err := visit(d, chain); err != nil {
				return err
			}
		}
		state[name] = done
		order = append(order, m)
		return nil
	}
	for _, n := range names {
		if err := visit(n, nil); err != nil {
			return nil, fmt.Errorf("module closure: %w", err)
		}
	}
	return order, nil
}
