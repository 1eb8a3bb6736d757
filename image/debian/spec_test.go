package debian

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
)

// minimalSpec is the smallest spec ParseSpec accepts.
const minimalSpec = `{"name":"t","suite":"bookworm","packages":["bash"],"users":[{"name":"agent","uid":1000,"home":"/home/agent","shell":"/bin/bash"}]}`

// validSpec returns a spec that validates, for a test to spoil one field.
func validSpec() *Spec {
	return &Spec{
		Name:     "test",
		Suite:    "bookworm",
		Packages: []string{"bash", "coreutils"},
		Users: []User{
			{Name: "agent", UID: 1000, Home: "/home/agent", Shell: "/bin/bash", Groups: []string{"users"}},
			{Name: "other", UID: 1001, Home: "/home/other", Shell: "/bin/sh"},
		},
		Files:       []File{{Path: "/etc/motd", Mode: "0644", Content: "hi\n"}},
		Env:         map[string]string{"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
		Compression: "lz4hc",
	}
}

func specJSON(t *testing.T, s *Spec) []byte {
	t.Helper()
	b, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestBuiltinAgent(t *testing.T) {
	s, err := Builtin("agent")
	if err != nil {
		t.Fatalf("Builtin(agent): %v", err)
	}
	if s.Name != "agent" {
		t.Errorf("name = %q, want agent", s.Name)
	}
	// The packages the agent image promises its users.
	for _, p := range []string{
		"bash", "coreutils", "findutils", "grep", "sed", "gawk", "tar", "gzip", "xz-utils", "zstd", "unzip",
		"git", "curl", "wget", "ca-certificates", "openssl",
		"python3", "python3-pip", "python3-venv", "nodejs", "npm", "build-essential", "pkg-config",
		"jq", "ripgrep", "sqlite3", "less", "file", "procps", "iproute2", "tmux",
	} {
		if !slices.Contains(s.Packages, p) {
			t.Errorf("agent spec lacks package %q", p)
		}
	}
	editors := []string{"nano", "vim", "vim-tiny", "vim-nox", "neovim", "emacs-nox", "micro"}
	if !slices.ContainsFunc(s.Packages, func(p string) bool { return slices.Contains(editors, p) }) {
		t.Errorf("agent spec has no editor (one of %v)", editors)
	}
	if len(s.Users) == 0 {
		t.Fatal("agent spec has no users")
	}
	u := s.Users[0]
	if u.Name != "agent" || u.UID != 1000 || u.Home != "/home/agent" {
		t.Errorf("first user = %+v, want agent uid 1000 home /home/agent", u)
	}
}

func TestBuiltinNames(t *testing.T) {
	names := BuiltinNames()
	if !slices.Contains(names, "agent") {
		t.Fatalf("BuiltinNames() = %v, want it to include agent", names)
	}
	for _, n := range names {
		if _, err := Builtin(n); err != nil {
			t.Errorf("Builtin(%q): %v", n, err)
		}
	}
}

func TestBuiltinUnknown(t *testing.T) {
	for _, name := range []string{"nope", "", "../agent", "specs/agent"} {
		_, err := Builtin(name)
		if err == nil {
			t.Errorf("Builtin(%q) = nil error", name)
			continue
		}
		if !strings.Contains(err.Error(), "agent") {
			t.Errorf("Builtin(%q) error %q does not name the built-in specs", name, err)
		}
	}
}

func TestParseSpecValid(t *testing.T) {
	for name, b := range map[string][]byte{
		"minimal":             []byte(minimalSpec),
		"full":                specJSON(t, validSpec()),
		"trailing whitespace": []byte(minimalSpec + "\n\t \n"),
	} {
		if _, err := ParseSpec(b); err != nil {
			t.Errorf("%s: ParseSpec: %v", name, err)
		}
	}
	for _, c := range []string{"", "lz4", "lz4hc"} {
		s := validSpec()
		s.Compression = c
		if _, err := ParseSpec(specJSON(t, s)); err != nil {
			t.Errorf("compression %q: %v", c, err)
		}
	}
}

func TestParseSpecRejects(t *testing.T) {
	spoil := func(f func(s *Spec)) []byte {
		s := validSpec()
		f(s)
		b, err := json.Marshal(s)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	cases := map[string][]byte{
		"not json":              []byte("not json"),
		"empty":                 []byte(""),
		"empty object":          []byte("{}"),
		"null":                  []byte("null"),
		"unknown field":         []byte(strings.Replace(minimalSpec, `"name"`, `"bogus":1,"name"`, 1)),
		"unknown field in user": []byte(strings.Replace(minimalSpec, `"uid"`, `"password":"x","uid"`, 1)),
		"trailing data":         []byte(minimalSpec + "{}"),
		"trailing junk":         []byte(minimalSpec + "x"),
		"two specs":             []byte(minimalSpec + minimalSpec),
		"too big":               append([]byte(minimalSpec), bytes.Repeat([]byte(" "), MaxSpecBytes)...),
		"no name":               spoil(func(s *Spec) { s.Name = "" }),
		"name uppercase":        spoil(func(s *Spec) { s.Name = "Agent" }),
		"name slash":            spoil(func(s *Spec) { s.Name = "a/b" }),
		"name dots":             spoil(func(s *Spec) { s.Name = ".." }),
		"name too long":         spoil(func(s *Spec) { s.Name = strings.Repeat("a", 64) }),
		"no suite":              spoil(func(s *Spec) { s.Suite = "" }),
		"suite path":            spoil(func(s *Spec) { s.Suite = "../bookworm" }),
		"suite space":           spoil(func(s *Spec) { s.Suite = "bookworm main" }),
		"suite option":          spoil(func(s *Spec) { s.Suite = "--variant=x" }),
		"suite upper":           spoil(func(s *Spec) { s.Suite = "Bookworm" }),
		"no packages":           spoil(func(s *Spec) { s.Packages = nil }),
		"empty packages":        spoil(func(s *Spec) { s.Packages = []string{} }),
		"too many packages": spoil(func(s *Spec) {
			s.Packages = slices.Repeat([]string{"bash"}, maxPackages+1)
		}),
		"package with space":   spoil(func(s *Spec) { s.Packages = append(s.Packages, "vim; rm -rf /") }),
		"package option":       spoil(func(s *Spec) { s.Packages = append(s.Packages, "-o") }),
		"package uppercase":    spoil(func(s *Spec) { s.Packages = append(s.Packages, "Foo") }),
		"package empty":        spoil(func(s *Spec) { s.Packages = append(s.Packages, "") }),
		"package comma":        spoil(func(s *Spec) { s.Packages = append(s.Packages, "bash,evil") }),
		"package dollar":       spoil(func(s *Spec) { s.Packages = append(s.Packages, "$(reboot)") }),
		"package backtick":     spoil(func(s *Spec) { s.Packages = append(s.Packages, "`id`") }),
		"package pipe":         spoil(func(s *Spec) { s.Packages = append(s.Packages, "a|b") }),
		"package newline":      spoil(func(s *Spec) { s.Packages = append(s.Packages, "bash\nevil") }),
		"package version":      spoil(func(s *Spec) { s.Packages = append(s.Packages, "bash=5.2") }),
		"package release":      spoil(func(s *Spec) { s.Packages = append(s.Packages, "bash/sid") }),
		"package arch":         spoil(func(s *Spec) { s.Packages = append(s.Packages, "bash:i386") }),
		"no users":             spoil(func(s *Spec) { s.Users = nil }),
		"user root":            spoil(func(s *Spec) { s.Users[0].Name = "root" }),
		"user empty":           spoil(func(s *Spec) { s.Users[0].Name = "" }),
		"user upper":           spoil(func(s *Spec) { s.Users[0].Name = "Agent" }),
		"user colon":           spoil(func(s *Spec) { s.Users[0].Name = "a:b" }),
		"user newline":         spoil(func(s *Spec) { s.Users[0].Name = "a\nroot" }),
		"uid 0":                spoil(func(s *Spec) { s.Users[0].UID = 0 }),
		"uid 999":              spoil(func(s *Spec) { s.Users[0].UID = 999 }),
		"uid 60000":            spoil(func(s *Spec) { s.Users[0].UID = 60000 }),
		"uid 65534":            spoil(func(s *Spec) { s.Users[0].UID = 65534 }),
		"uid negative":         spoil(func(s *Spec) { s.Users[0].UID = -1 }),
		"duplicate user":       spoil(func(s *Spec) { s.Users[1].Name = s.Users[0].Name }),
		"duplicate uid":        spoil(func(s *Spec) { s.Users[1].UID = s.Users[0].UID }),
		"home outside /home":   spoil(func(s *Spec) { s.Users[0].Home = "/root" }),
		"home is /home":        spoil(func(s *Spec) { s.Users[0].Home = "/home" }),
		"home /home/":          spoil(func(s *Spec) { s.Users[0].Home = "/home/" }),
		"home prefix only":     spoil(func(s *Spec) { s.Users[0].Home = "/homex/agent" }),
		"home unclean":         spoil(func(s *Spec) { s.Users[0].Home = "/home/../etc" }),
		"home dot":             spoil(func(s *Spec) { s.Users[0].Home = "/home/./agent" }),
		"home relative":        spoil(func(s *Spec) { s.Users[0].Home = "home/agent" }),
		"home colon":           spoil(func(s *Spec) { s.Users[0].Home = "/home/a:b" }),
		"shell relative":       spoil(func(s *Spec) { s.Users[0].Shell = "bash" }),
		"shell empty":          spoil(func(s *Spec) { s.Users[0].Shell = "" }),
		"shell unclean":        spoil(func(s *Spec) { s.Users[0].Shell = "/bin/../bin/bash" }),
		"shell colon":          spoil(func(s *Spec) { s.Users[0].Shell = "/bin/ba:sh" }),
		"shell newline":        spoil(func(s *Spec) { s.Users[0].Shell = "/bin/bash\nroot::0:0::/:/bin/sh" }),
		"group bad":            spoil(func(s *Spec) { s.Users[0].Groups = []string{"a,b"} }),
		"group colon":          spoil(func(s *Spec) { s.Users[0].Groups = []string{"users:x"} }),
		"file relative":        spoil(func(s *Spec) { s.Files[0].Path = "etc/motd" }),
		"file empty path":      spoil(func(s *Spec) { s.Files[0].Path = "" }),
		"file unclean":         spoil(func(s *Spec) { s.Files[0].Path = "/etc/../etc/motd" }),
		"file dotdot escape":   spoil(func(s *Spec) { s.Files[0].Path = "/../etc/motd" }),
		"file trailing slash":  spoil(func(s *Spec) { s.Files[0].Path = "/etc/motd/" }),
		"file root":            spoil(func(s *Spec) { s.Files[0].Path = "/" }),
		"file /proc":           spoil(func(s *Spec) { s.Files[0].Path = "/proc/x" }),
		"file /sys":            spoil(func(s *Spec) { s.Files[0].Path = "/sys/x" }),
		"file /dev":            spoil(func(s *Spec) { s.Files[0].Path = "/dev/x" }),
		"file /dev itself":     spoil(func(s *Spec) { s.Files[0].Path = "/dev" }),
		"file /run":            spoil(func(s *Spec) { s.Files[0].Path = "/run/x" }),
		"file /tmp":            spoil(func(s *Spec) { s.Files[0].Path = "/tmp/x" }),
		"file /workspace":      spoil(func(s *Spec) { s.Files[0].Path = "/workspace/x" }),
		"file /workspace self": spoil(func(s *Spec) { s.Files[0].Path = "/workspace" }),
		"file newline":         spoil(func(s *Spec) { s.Files[0].Path = "/etc/a\nb" }),
		"file nul":             spoil(func(s *Spec) { s.Files[0].Path = "/etc/a\x00b" }),
		"mode 3 digits":        spoil(func(s *Spec) { s.Files[0].Mode = "644" }),
		"mode 5 digits":        spoil(func(s *Spec) { s.Files[0].Mode = "00644" }),
		"mode not octal":       spoil(func(s *Spec) { s.Files[0].Mode = "0999" }),
		"mode trailing junk":   spoil(func(s *Spec) { s.Files[0].Mode = "07777x" }),
		"mode empty":           spoil(func(s *Spec) { s.Files[0].Mode = "" }),
		"mode sign":            spoil(func(s *Spec) { s.Files[0].Mode = "+644" }),
		"mode prefix":          spoil(func(s *Spec) { s.Files[0].Mode = "0o64" }),
		"too many files": spoil(func(s *Spec) {
			s.Files = slices.Repeat([]File{{Path: "/etc/x", Mode: "0644"}}, maxFiles+1)
		}),
		"env name digit":  spoil(func(s *Spec) { s.Env["1X"] = "v" }),
		"env name dash":   spoil(func(s *Spec) { s.Env["A-B"] = "v" }),
		"env name empty":  spoil(func(s *Spec) { s.Env[""] = "v" }),
		"env name equals": spoil(func(s *Spec) { s.Env["A=B"] = "v" }),
		"env name space":  spoil(func(s *Spec) { s.Env["A B"] = "v" }),
		"env newline":     spoil(func(s *Spec) { s.Env["X"] = "a\nb" }),
		"env dollar":      spoil(func(s *Spec) { s.Env["X"] = "$(id)" }),
		"env backquote":   spoil(func(s *Spec) { s.Env["X"] = "`id`" }),
		"env too large": spoil(func(s *Spec) {
			for i := 0; i < 20; i++ {
				s.Env[fmt.Sprintf("V%d", i)] = strings.Repeat("v", 4000)
			}
		}),
		"env quote":        spoil(func(s *Spec) { s.Env["X"] = `a"b` }),
		"env backslash":    spoil(func(s *Spec) { s.Env["X"] = `a\b` }),
		"env nul":          spoil(func(s *Spec) { s.Env["X"] = "a\x00b" }),
		"env value long":   spoil(func(s *Spec) { s.Env["X"] = strings.Repeat("a", 4097) }),
		"compression gzip": spoil(func(s *Spec) { s.Compression = "gzip" }),
		"compression zstd": spoil(func(s *Spec) { s.Compression = "zstd" }),
		"compression case": spoil(func(s *Spec) { s.Compression = "LZ4HC" }),
	}
	for name, b := range cases {
		s, err := ParseSpec(b)
		if err == nil {
			t.Errorf("%s: ParseSpec accepted %s", name, b)
			continue
		}
		if s != nil {
			t.Errorf("%s: ParseSpec returned a spec with its error", name)
		}
		if !errors.Is(err, ErrInvalidSpec) {
			t.Errorf("%s: error %q does not wrap ErrInvalidSpec", name, err)
		}
	}
}

func TestParseSpecLimitsInclusive(t *testing.T) {
	s := validSpec()
	s.Users[0].UID, s.Users[1].UID = 1000, 59999
	s.Env["X"] = strings.Repeat("a", 4096)
	s.Files[0].Mode = "7777"
	s.Packages = slices.Repeat([]string{"bash"}, maxPackages)
	if _, err := ParseSpec(specJSON(t, s)); err != nil {
		t.Fatalf("spec at the limits refused: %v", err)
	}
}

func TestCanonicalPackageOrder(t *testing.T) {
	a := validSpec()
	a.Packages = []string{"bash", "coreutils", "git"}
	b := validSpec()
	b.Packages = []string{"git", "bash", "coreutils", "bash", "git"}
	if ca, cb := a.Canonical(), b.Canonical(); !bytes.Equal(ca, cb) {
		t.Errorf("Canonical differs under reordering and duplicates:\n%s\n%s", ca, cb)
	}
	if !slices.Equal(b.Packages, []string{"git", "bash", "coreutils", "bash", "git"}) {
		t.Errorf("Canonical changed the spec's own packages: %v", b.Packages)
	}
	if !bytes.Equal(a.Canonical(), a.Canonical()) {
		t.Error("Canonical is not stable across calls")
	}
	// The env is a map: its order must not matter either.
	c := validSpec()
	c.Env = map[string]string{}
	for _, k := range []string{"Z", "A", "M", "B"} {
		c.Env[k] = k
	}
	first := c.Canonical()
	for range 20 {
		if !bytes.Equal(first, c.Canonical()) {
			t.Fatal("Canonical depends on map iteration order")
		}
	}
}

func TestCanonicalDiffers(t *testing.T) {
	base := validSpec().Canonical()
	for name, f := range map[string]func(s *Spec){
		"name":         func(s *Spec) { s.Name = "other" },
		"suite":        func(s *Spec) { s.Suite = "trixie" },
		"package":      func(s *Spec) { s.Packages = append(s.Packages, "git") },
		"package gone": func(s *Spec) { s.Packages = s.Packages[:1] },
		"user name":    func(s *Spec) { s.Users[0].Name = "bob" },
		"uid":          func(s *Spec) { s.Users[0].UID = 2000 },
		"home":         func(s *Spec) { s.Users[0].Home = "/home/x" },
		"shell":        func(s *Spec) { s.Users[0].Shell = "/bin/sh" },
		"groups":       func(s *Spec) { s.Users[0].Groups = nil },
		"user order":   func(s *Spec) { s.Users[0], s.Users[1] = s.Users[1], s.Users[0] },
		"file path":    func(s *Spec) { s.Files[0].Path = "/etc/issue" },
		"file mode":    func(s *Spec) { s.Files[0].Mode = "0600" },
		"file content": func(s *Spec) { s.Files[0].Content = "bye\n" },
		"file added":   func(s *Spec) { s.Files = append(s.Files, File{Path: "/etc/x", Mode: "0644"}) },
		"env value":    func(s *Spec) { s.Env["LANG"] = "C" },
		"env added":    func(s *Spec) { s.Env["X"] = "1" },
		"env removed":  func(s *Spec) { delete(s.Env, "LANG") },
		"compression":  func(s *Spec) { s.Compression = "" },
	} {
		s := validSpec()
		f(s)
		if bytes.Equal(base, s.Canonical()) {
			t.Errorf("Canonical unchanged when %s changes", name)
		}
	}
}

func FuzzParseSpec(f *testing.F) {
	agent, err := builtins.ReadFile("specs/agent.json")
	if err != nil {
		f.Fatal(err)
	}
	f.Add(agent)
	f.Add([]byte(`{}`))
	f.Add([]byte(minimalSpec))
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := ParseSpec(b)
		if err != nil {
			if !errors.Is(err, ErrInvalidSpec) {
				t.Fatalf("error %q does not wrap ErrInvalidSpec", err)
			}
			return
		}
		if err := s.Validate(); err != nil {
			t.Fatalf("accepted spec does not validate again: %v", err)
		}
		c := s.Canonical()
		var back Spec
		if err := json.Unmarshal(c, &back); err != nil {
			t.Fatalf("Canonical %s does not parse: %v", c, err)
		}
		if err := back.Validate(); err != nil {
			t.Fatalf("Canonical %s does not validate: %v", c, err)
		}
		if !bytes.Equal(back.Canonical(), c) {
			t.Fatalf("Canonical is not a fixed point:\n%s\n%s", c, back.Canonical())
		}
		if _, err := ParseSpec(c); err != nil {
			t.Fatalf("ParseSpec(Canonical) = %v", err)
		}
	})
}
