package manifest

import (
	"errors"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/image/verity"
)

// validSystem is a manifest with a verified root of 256 blocks.
func validSystem(t testing.TB) *Manifest {
	t.Helper()
	m := valid()
	v := &Verity{
		Mount:         MountRoot,
		RootHash:      strings.Repeat("ab", 32),
		HashAlg:       "sha256",
		DataBlockSize: 4096,
		HashBlockSize: 4096,
		DataBlocks:    256,
		Salt:          strings.Repeat("01", 32),
		UUID:          "6361726c-0000-8000-8000-000000000001",
	}
	p, _, err := v.Params()
	if err != nil {
		t.Fatal(err)
	}
	m.System = &Part{Digest: DigestBytes([]byte("system")), Size: 256 * 4096}
	m.SystemVerity = &Part{Digest: DigestBytes([]byte("hash")), Size: verity.HashSize(p)}
	m.Verity = v
	m.Cmdline += " roothash=" + v.RootHash + " systemd.verity_root_data=/dev/disk/by-id/virtio-carrel-system"
	m.Packages = []Package{{Name: "bash", Version: "5.2.15-2+b7", Arch: "amd64"}, {Name: "linux-image-6.1.0-56-amd64", Version: "6.1.192-2"}}
	return m
}

func TestSystemRoundTrip(t *testing.T) {
	m := validSystem(t)
	b, err := m.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	got, err := Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	if got.Verity.RootHash != m.Verity.RootHash || len(got.Packages) != 2 || len(got.Parts()) != 4 {
		t.Fatalf("round trip: %+v", got)
	}
	if names := []string{got.Parts()[2].Name, got.Parts()[3].Name}; names[0] != PartSystem || names[1] != PartSystemVerity {
		t.Errorf("parts %v", names)
	}
}

func TestSystemRejects(t *testing.T) {
	cases := map[string]func(m *Manifest){
		"no hash device":       func(m *Manifest) { m.SystemVerity = nil },
		"no verity":            func(m *Manifest) { m.Verity = nil },
		"schema 1":             func(m *Manifest) { m.SchemaVersion = 1; m.Packages = nil },
		"data size":            func(m *Manifest) { m.System.Size += 4096 },
		"hash size":            func(m *Manifest) { m.SystemVerity.Size++ },
		"absurd part":          func(m *Manifest) { m.System.Size = MaxPartSize + 1 },
		"mount":                func(m *Manifest) { m.Verity.Mount = "home" },
		"usr without usrhash":  func(m *Manifest) { m.Verity.Mount = MountUsr },
		"algorithm":            func(m *Manifest) { m.Verity.HashAlg = "md5" },
		"block size":           func(m *Manifest) { m.Verity.DataBlockSize = 1000 },
		"block size 8k":        func(m *Manifest) { m.Verity.DataBlockSize, m.Verity.DataBlocks = 8192, 128 },
		"hash block 512":       func(m *Manifest) { m.Verity.HashBlockSize = 512 },
		"root hash":            func(m *Manifest) { m.Verity.RootHash = "AB" },
		"root hash upper":      func(m *Manifest) { m.Verity.RootHash = strings.Repeat("AB", 32) },
		"salt":                 func(m *Manifest) { m.Verity.Salt = "xyz" },
		"salt too long":        func(m *Manifest) { m.Verity.Salt = strings.Repeat("00", 257) },
		"uuid":                 func(m *Manifest) { m.Verity.UUID = "not-a-uuid" },
		"cmdline without hash": func(m *Manifest) { m.Cmdline = "console=ttyS0" },
		"cmdline other hash":   func(m *Manifest) { m.Cmdline = "roothash=" + strings.Repeat("cd", 32) },
		"cmdline hash twice":   func(m *Manifest) { m.Cmdline += " roothash=" + m.Verity.RootHash },
		"hash without root": func(m *Manifest) {
			m.System, m.SystemVerity, m.Verity = nil, nil, nil
		},
		"packages unsorted":  func(m *Manifest) { m.Packages[0], m.Packages[1] = m.Packages[1], m.Packages[0] },
		"package duplicate":  func(m *Manifest) { m.Packages[1] = m.Packages[0] },
		"package name space": func(m *Manifest) { m.Packages[0].Name = "a b" },
		"package empty name": func(m *Manifest) { m.Packages[0].Name = "" },
		"package version":    func(m *Manifest) { m.Packages[0].Version = "1\n2" },
	}
	for name, mutate := range cases {
		t.Run(name, func(t *testing.T) {
			m := validSystem(t)
			mutate(m)
			if err := m.Validate(); !errors.Is(err, ErrInvalid) {
				t.Fatalf("Validate = %v, want ErrInvalid", err)
			}
		})
	}
}

func TestSortPackages(t *testing.T) {
	got := SortPackages([]Package{{Name: "b", Version: "1"}, {Name: "a", Version: "2"}, {Name: "a", Version: "1"}, {Name: "b", Version: "1"}})
	want := []Package{{Name: "a", Version: "1"}, {Name: "a", Version: "2"}, {Name: "b", Version: "1"}}
	if len(got) != len(want) {
		t.Fatalf("got %v", got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("got %v want %v", got, want)
		}
	}
	if err := validatePackages(got); err != nil {
		t.Fatal(err)
	}
}

func TestUUID(t *testing.T) {
	u, err := ParseUUID("6361726c-0000-8000-8000-0000000000ff")
	if err != nil || FormatUUID(u) != "6361726c-0000-8000-8000-0000000000ff" {
		t.Fatalf("%x %v", u, err)
	}
	for _, bad := range []string{"", "6361726c00008000800000000000000000ff", "6361726c-0000-8000-8000-0000000000fg", "6361726c-0000-8000-8000-0000000000ff0"} {
		if _, err := ParseUUID(bad); err == nil {
			t.Errorf("ParseUUID(%q) succeeded", bad)
		}
	}
}
