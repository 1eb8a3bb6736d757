package debian

import (
	"bytes"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/carrel-os/carrel/image/manifest"
)

// ErrInvalidSpec wraps every reason a spec is refused.
var ErrInvalidSpec = errors.New("invalid image spec")

// Limits on a spec, which an API caller sends.
const (
	MaxSpecBytes = 1 << 20
	maxPackages  = 2000
	maxUsers     = 32
	maxFiles     = 256
	maxEnv       = 256
	// maxEnvBytes keeps /etc/environment within what carrel-agent reads
	// (64 KiB), with room for the image's own lines.
	maxEnvBytes = 60 << 10
)

// Spec says what goes into an image built from Debian packages.
type Spec struct {
	// Name is the image's name (its manifest's, and its default tag).
	Name string `json:"name"`
	// Suite is the Debian suite, e.g. "bookworm".
	Suite string `json:"suite"`
	// Packages are installed with apt, with what they depend on.
	Packages []string `json:"packages"`
	// Users are created with their homes (from /etc/skel). Commands run
	// as the first; carrel-agent expects one named "agent".
	Users []User `json:"users"`
	// Files are written into the root after the packages are installed.
	Files []File `json:"files,omitempty"`
	// Env is every command's environment (/etc/environment, which
	// carrel-agent reads, and a login shell's profile).
	Env map[string]string `json:"env,omitempty"`
	// Compression is the root file system's: "" (none) or "lz4hc".
	Compression string `json:"compression,omitempty"`
	// Init is the image's init: "" (carrel-agent, which stays PID 1 after
	// it switches to the verified root) or "systemd" (carrel-agent hands
	// over to systemd, which runs it as a service; the builder adds the
	// systemd and udev packages, the agent and its unit).
	Init string `json:"init,omitempty"`
}

// InitSystemd is Spec.Init for an image whose init is systemd.
const InitSystemd = "systemd"

// User is an account of the image.
type User struct {
	Name  string `json:"name"`
	UID   int    `json:"uid"`
	Home  string `json:"home"`
	Shell string `json:"shell"`
	// Groups are existing groups the user joins.
	Groups []string `json:"groups,omitempty"`
}

// File is one file of the image.
type File struct {
	Path    string `json:"path"`
	Mode    string `json:"mode"` // octal, e.g. "0644"
	Content string `json:"content"`
}

var (
	packageRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[a-z0-9][a-z0-9+.-]{0,99}$`) })
	suiteRE   = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[a-z][a-z0-9-]{0,31}$`) })
	userRE    = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[a-z_][a-z0-9_-]{0,31}$`) })
	envRE     = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,127}$`) })
)

//go:embed specs/*.json
var builtins embed.FS

// Builtin returns the built-in spec name ("agent").
func Builtin(name string) (*Spec, error) {
	b, err := builtins.ReadFile("specs/" + name + ".json")
	if err != nil {
		return nil, fmt.Errorf("no built-in image spec %q (have %s)", name, strings.Join(BuiltinNames(), ", "))
	}
	return ParseSpec(b)
}

// BuiltinNames lists the built-in specs.
func BuiltinNames() []string {
	ents, _ := builtins.ReadDir("specs")
	var names []string
	for _, e := range ents {
		names = append(names, strings.TrimSuffix(e.Name(), ".json"))
	}
	return names
}

// ParseSpec decodes and validates a spec. Unknown fields, trailing data
// and anything over MaxSpecBytes are refused.
func ParseSpec(b []byte) (*Spec, error) {
	if len(b) > MaxSpecBytes {
		return nil, fmt.Errorf("%w: %d bytes, limit %d", ErrInvalidSpec, len(b), MaxSpecBytes)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var s Spec
	if err := dec.Decode(&s); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidSpec, err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%w: trailing data after the spec", ErrInvalidSpec)
	}
	if err := s.Validate(); err != nil {
		return nil, err
	}
	return &s, nil
}

// Validate returns an error wrapping ErrInvalidSpec naming the first bad
// field.
func (s *Spec) Validate() error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrInvalidSpec}, a...)...)
	}
	if !manifest.ValidName(s.Name) {
		return bad("name %q: want [a-z0-9][a-z0-9._-]{0,62}", s.Name)
	}
	if !suiteRE().MatchString(s.Suite) {
		return bad("suite %q", s.Suite)
	}
	if len(s.Packages) == 0 || len(s.Packages) > maxPackages {
		return bad("%d packages: want 1 to %d", len(s.Packages), maxPackages)
	}
	for _, p := range s.Packages {
		if !packageRE().MatchString(p) {
			return bad("package %q is not a Debian package name", p)
		}
	}
	if len(s.Users) == 0 || len(s.Users) > maxUsers {
		return bad("%d users: want 1 to %d", len(s.Users), maxUsers)
	}
	seen := map[string]bool{}
	uids := map[int]bool{}
	for _, u := range s.Users {
		switch {
		case !userRE().MatchString(u.Name) || u.Name == "root":
			return bad("user name %q", u.Name)
		case seen[u.Name] || uids[u.UID]:
			return bad("user %q or uid %d given twice", u.Name, u.UID)
		case u.UID < 1000 || u.UID > 59999:
			return bad("user %q: uid %d: want 1000 to 59999", u.Name, u.UID)
		case !cleanAbs(u.Home) || !strings.HasPrefix(u.Home, "/home/") || strings.Contains(u.Home, ":"):
			// A colon would add a field to the user's /etc/passwd line.
			return bad("user %q: home %q: want a clean path under /home", u.Name, u.Home)
		case !cleanAbs(u.Shell) || strings.Contains(u.Shell, ":"):
			return bad("user %q: shell %q", u.Name, u.Shell)
		}
		for _, g := range u.Groups {
			if !userRE().MatchString(g) {
				return bad("user %q: group %q", u.Name, g)
			}
		}
		seen[u.Name], uids[u.UID] = true, true
	}
	if len(s.Files) > maxFiles {
		return bad("%d files, limit %d", len(s.Files), maxFiles)
	}
	for _, f := range s.Files {
		if !cleanAbs(f.Path) || f.Path == "/" {
			return bad("file %q: want a clean absolute path", f.Path)
		}
		for _, top := range []string{"/proc", "/sys", "/dev", "/run", "/tmp", "/workspace"} {
			if f.Path == top || strings.HasPrefix(f.Path, top+"/") {
				return bad("file %q: %s is not part of the image", f.Path, top)
			}
		}
		if _, err := f.perm(); err != nil {
			return bad("file %q: %v", f.Path, err)
		}
	}
	if len(s.Env) > maxEnv {
		return bad("%d environment variables, limit %d", len(s.Env), maxEnv)
	}
	envBytes := 0
	for k, v := range s.Env {
		// The value is written as KEY="VALUE" for carrel-agent, which takes
		// it as it is, and for a login shell, which must not expand it.
		if !envRE().MatchString(k) || strings.ContainsAny(v, "\x00\n\"\\$`") || len(v) > 4096 {
			return bad("environment variable %q: want a name of [A-Za-z0-9_] and a value without quotes, backslashes, $, backquotes or newlines", k)
		}
		envBytes += len(k) + len(v) + 4
	}
	if envBytes > maxEnvBytes {
		return bad("the environment is %d bytes, limit %d (what carrel-agent reads of /etc/environment)", envBytes, maxEnvBytes)
	}
	if s.Compression != "" && s.Compression != "lz4hc" && s.Compression != "lz4" {
		return bad("compression %q: want \"\", \"lz4\" or \"lz4hc\"", s.Compression)
	}
	if s.Init != "" && s.Init != InitSystemd {
		return bad("init %q: want \"\" (carrel-agent) or %q", s.Init, InitSystemd)
	}
	return nil
}

func (f File) perm() (fs.FileMode, error) {
	m, err := strconv.ParseUint(f.Mode, 8, 32)
	if err != nil || m > 0o7777 || len(f.Mode) != 4 {
		return 0, fmt.Errorf("mode %q: want four octal digits, e.g. 0644", f.Mode)
	}
	// Go keeps the setuid, setgid and sticky bits apart from the octal
	// permission bits: 0o4000 as a FileMode is not setuid.
	perm := fs.FileMode(m & 0o777)
	for bit, mode := range map[uint64]fs.FileMode{0o4000: fs.ModeSetuid, 0o2000: fs.ModeSetgid, 0o1000: fs.ModeSticky} {
		if m&bit != 0 {
			perm |= mode
		}
	}
	return perm, nil
}

func cleanAbs(p string) bool {
	return strings.HasPrefix(p, "/") && path.Clean(p) == p && !strings.ContainsAny(p, "\x00\n")
}

// Canonical is the spec's canonical encoding (sorted lists where order does
// not matter), which its cache key hashes.
func (s *Spec) Canonical() []byte {
	c := *s
	c.Packages = slices.Clone(s.Packages)
	slices.Sort(c.Packages)
	c.Packages = slices.Compact(c.Packages)
	b, _ := json.Marshal(c) // maps marshal with sorted keys
	return b
}
