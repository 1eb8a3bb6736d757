package manifest

import (
	"cmp"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"

	"github.com/carrel-os/carrel/image/verity"
)

// Mounts a verified file system can have (Verity.Mount).
const (
	// MountRoot is the whole root file system, which the guest overlays
	// with the VM's own writable layer; the command line names its root
	// hash with roothash=.
	MountRoot = "root"
	// MountUsr is /usr (or the Nix store under it), as NixOS's
	// image.repart.verityStore builds it; the command line has usrhash=.
	MountUsr = "usr"
)

// BlockSize is the verity data and hash block size of every image: the
// guest's page size.
const BlockSize = 4096

// Limits on the package list.
const (
	MaxPackages       = 50000
	maxPackageName    = 200
	maxPackageVersion = 200
)

// Verity is the dm-verity layout of System and SystemVerity. SystemVerity
// starts with veritysetup's version-1 superblock in its first hash block;
// the tree follows it.
type Verity struct {
	Mount string `json:"mount"`
	// RootHash is the tree's root, lower-case hex; the command line carries
	// the same value (roothash= or usrhash=).
	RootHash      string `json:"root_hash"`
	HashAlg       string `json:"hash_alg"`
	DataBlockSize uint32 `json:"data_block_size"`
	HashBlockSize uint32 `json:"hash_block_size"`
	DataBlocks    uint64 `json:"data_blocks"`
	// Salt is hex, "" for none; UUID is the superblock's, in the usual
	// 8-4-4-4-12 form.
	Salt string `json:"salt"`
	UUID string `json:"uuid"`
}

// Package is one package of the image: a Debian package, or a Nix store
// path's name and version.
type Package struct {
	Name    string `json:"name"`
	Version string `json:"version"`
	// Arch is the package's architecture where it has one (Debian).
	Arch string `json:"arch,omitempty"`
}

// HashParam is the kernel command-line word that carries the root hash of
// a verified file system mounted at mount: roothash or usrhash.
func HashParam(mount string) string {
	if mount == MountUsr {
		return "usrhash"
	}
	return "roothash"
}

// Params returns the verity parameters and the root hash as bytes.
func (v *Verity) Params() (verity.Params, []byte, error) {
	root, err := hex.DecodeString(v.RootHash)
	if err != nil || len(root) != 32 || strings.ToLower(v.RootHash) != v.RootHash {
		return verity.Params{}, nil, fmt.Errorf("%w: verity root_hash %q: want 64 lower-case hex digits", ErrInvalid, v.RootHash)
	}
	salt, err := hex.DecodeString(v.Salt)
	if err != nil || len(salt) > 256 || strings.ToLower(v.Salt) != v.Salt {
		return verity.Params{}, nil, fmt.Errorf("%w: verity salt %q: want at most 256 bytes of lower-case hex", ErrInvalid, v.Salt)
	}
	uuid, err := ParseUUID(v.UUID)
	if err != nil {
		return verity.Params{}, nil, fmt.Errorf("%w: verity uuid: %w", ErrInvalid, err)
	}
	p := verity.Params{
		HashAlg:       v.HashAlg,
		DataBlockSize: v.DataBlockSize,
		HashBlockSize: v.HashBlockSize,
		DataBlocks:    v.DataBlocks,
		Salt:          salt,
		UUID:          uuid,
	}
	if err := p.Validate(); err != nil {
		return verity.Params{}, nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return p, root, nil
}

// ParseUUID reads a UUID in its 8-4-4-4-12 hex form.
func ParseUUID(s string) ([16]byte, error) {
	var u [16]byte
	h := strings.ReplaceAll(s, "-", "")
	if len(s) != 36 || len(h) != 32 || s[8] != '-' || s[13] != '-' || s[18] != '-' || s[23] != '-' {
		return u, fmt.Errorf("%q is not of the form xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", s)
	}
	if _, err := hex.Decode(u[:], []byte(h)); err != nil {
		return u, fmt.Errorf("%q: %w", s, err)
	}
	return u, nil
}

// FormatUUID writes u in its 8-4-4-4-12 lower-case hex form.
func FormatUUID(u [16]byte) string {
	h := hex.EncodeToString(u[:])
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

// validateSystem checks the verified root's parts against its verity
// parameters and the command line, and the package list.
func (m *Manifest) validateSystem() error {
	n := 0
	for _, set := range []bool{m.System != nil, m.SystemVerity != nil, m.Verity != nil} {
		if set {
			n++
		}
	}
	if n > 0 && m.SchemaVersion < 2 {
		return fmt.Errorf("%w: schema_version 1 has no verified root", ErrInvalid)
	}
	if n != 0 && n != 3 {
		return fmt.Errorf("%w: system, system_verity and verity go together: all or none", ErrInvalid)
	}
	if n == 3 {
		if err := m.System.validate(); err != nil {
			return fmt.Errorf("system: %w", err)
		}
		if err := m.SystemVerity.validate(); err != nil {
			return fmt.Errorf("system_verity: %w", err)
		}
		v := m.Verity
		if v.Mount != MountRoot && v.Mount != MountUsr {
			return fmt.Errorf("%w: verity mount %q: want %q or %q", ErrInvalid, v.Mount, MountRoot, MountUsr)
		}
		p, _, err := v.Params()
		if err != nil {
			return err
		}
		// The guest's kernel takes no data block larger than its page,
		// and carrel's builders all use 4 KiB; smaller blocks would only
		// make the tree (which the host recomputes in memory) larger.
		if p.DataBlockSize != BlockSize || p.HashBlockSize != BlockSize {
			return fmt.Errorf("%w: verity block sizes %d and %d: want %d", ErrInvalid, p.DataBlockSize, p.HashBlockSize, BlockSize)
		}
		if want := int64(p.DataBlocks) * int64(p.DataBlockSize); m.System.Size != want {
			return fmt.Errorf("%w: system is %d bytes, but verity covers %d blocks of %d (%d bytes)",
				ErrInvalid, m.System.Size, p.DataBlocks, p.DataBlockSize, want)
		}
		if want := verity.HashSize(p); m.SystemVerity.Size != want {
			return fmt.Errorf("%w: system_verity is %d bytes; its verity parameters make it %d", ErrInvalid, m.SystemVerity.Size, want)
		}
		if err := checkHashParam(m.Cmdline, HashParam(v.Mount), v.RootHash); err != nil {
			return err
		}
	} else if hasParam(m.Cmdline, "roothash") || hasParam(m.Cmdline, "usrhash") {
		return fmt.Errorf("%w: cmdline names a root hash, but the image has no verified root", ErrInvalid)
	}
	if m.SchemaVersion < 2 && m.Packages != nil {
		return fmt.Errorf("%w: schema_version 1 has no package list", ErrInvalid)
	}
	return validatePackages(m.Packages)
}

// checkHashParam requires the command line to set param exactly once, to
// want.
func checkHashParam(cmdline, param, want string) error {
	var got []string
	for _, f := range strings.Fields(cmdline) {
		if k, v, ok := strings.Cut(f, "="); ok && k == param {
			got = append(got, v)
		}
	}
	switch {
	case len(got) == 0:
		return fmt.Errorf("%w: cmdline has no %s=, which the verified root needs", ErrInvalid, param)
	case len(got) > 1:
		return fmt.Errorf("%w: cmdline sets %s= %d times", ErrInvalid, param, len(got))
	case got[0] != want:
		return fmt.Errorf("%w: cmdline's %s=%s differs from the verity root hash %s", ErrInvalid, param, got[0], want)
	}
	return nil
}

func hasParam(cmdline, param string) bool {
	for _, f := range strings.Fields(cmdline) {
		if k, _, _ := strings.Cut(f, "="); k == param {
			return true
		}
	}
	return false
}

func validatePackages(ps []Package) error {
	if len(ps) > MaxPackages {
		return fmt.Errorf("%w: %d packages, limit %d", ErrInvalid, len(ps), MaxPackages)
	}
	for i, p := range ps {
		if !printableWord(p.Name, maxPackageName) || p.Name == "" {
			return fmt.Errorf("%w: package %d: name %q: want 1 to %d printable characters, no spaces", ErrInvalid, i, p.Name, maxPackageName)
		}
		if !printableWord(p.Version, maxPackageVersion) {
			return fmt.Errorf("%w: package %q: version %q: want at most %d printable characters, no spaces", ErrInvalid, p.Name, p.Version, maxPackageVersion)
		}
		if !printableWord(p.Arch, 32) {
			return fmt.Errorf("%w: package %q: arch %q", ErrInvalid, p.Name, p.Arch)
		}
		if i > 0 && !packageLess(ps[i-1], p) {
			return fmt.Errorf("%w: packages are not sorted and unique at %q %q", ErrInvalid, p.Name, p.Version)
		}
	}
	return nil
}

func packageLess(a, b Package) bool {
	if a.Name != b.Name {
		return a.Name < b.Name
	}
	if a.Version != b.Version {
		return a.Version < b.Version
	}
	return a.Arch < b.Arch
}

// SortPackages sorts ps as a manifest holds them and drops exact
// duplicates.
func SortPackages(ps []Package) []Package {
	out := slices.Clone(ps)
	slices.SortFunc(out, func(a, b Package) int {
		return cmp.Or(cmp.Compare(a.Name, b.Name), cmp.Compare(a.Version, b.Version), cmp.Compare(a.Arch, b.Arch))
	})
	return slices.Compact(out)
}

func printableWord(s string, max int) bool {
	if len(s) > max {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] <= 0x20 || s[i] >= 0x7f {
			return false
		}
	}
	return true
}
