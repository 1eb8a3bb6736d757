// Package manifest defines the image manifest: the content digests of the
// parts a VM boots from, the kernel command line they were built for, the
// dm-verity parameters of the read-only root, and the packages in it.
//
// A manifest names its parts only by digest and carries no timestamps, so the
// same inputs always give the same manifest digest, and that digest is the
// image's identity: it covers every part, the verity root hash and the
// package list. docs/image-format.md describes the format.
package manifest

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"strings"
	"sync"
)

// SchemaVersion is the manifest schema this package writes. Version 2 adds
// the verified root (System, SystemVerity, Verity) and the package list;
// Parse still reads version 1 (an initramfs-only image), which has neither.
const SchemaVersion = 2

// MaxSize bounds an encoded manifest; Parse rejects anything larger. The
// package list of a full userland takes most of it.
const MaxSize = 4 << 20

// MaxPartSize bounds one part: no kernel, initrd or root file system of a
// guest image comes near it, and a manifest that claims more is hostile.
const MaxPartSize = 64 << 30

// KernelCmdlineSize is x86's COMMAND_LINE_SIZE: the kernel keeps at most
// this many bytes of its command line, less the terminating NUL, and drops
// the rest without a word.
const KernelCmdlineSize = 2048

// MaxCmdline bounds an image's kernel command line. It leaves room for the
// words carreld appends at boot (the writable layer, the workspace, limits,
// the machine's needs), which must not be cut off.
const MaxCmdline = KernelCmdlineSize - 256

// DigestPrefix starts every digest this package accepts.
const DigestPrefix = "sha256:"

// ErrInvalid wraps every validation and parse failure.
var ErrInvalid = errors.New("invalid image manifest")

// Part is one content-addressed file of an image.
type Part struct {
	// Digest is "sha256:" followed by 64 lower-case hex digits.
	Digest string `json:"digest"`
	// Size is the file's length in bytes; always positive.
	Size int64 `json:"size"`
}

// Manifest describes a bootable image. Its JSON encoding is canonical: the
// encoding/json output of this struct, which is deterministic.
type Manifest struct {
	SchemaVersion int    `json:"schema_version"`
	Name          string `json:"name"`
	Arch          string `json:"arch"`
	KernelVersion string `json:"kernel_version"`
	Kernel        Part   `json:"kernel"`
	Initrd        Part   `json:"initrd"`
	// Cmdline is the default kernel command line for this image.
	Cmdline string `json:"cmdline"`
	// Workspace, when set, is the template of each VM's workspace disk: a
	// raw ext4 file system that every VM's copy-on-write qcow2 disk has as
	// its backing file (see image/workspace). Without it, VMs of the image
	// keep their workspace in memory (tmpfs).
	Workspace *Part `json:"workspace,omitempty"`
	// System is the read-only root file system (erofs) and SystemVerity
	// its dm-verity hash device (a superblock, then the hash tree); Verity
	// holds the parameters that tie them to the root hash on Cmdline. All
	// three are set, or none (an image whose root is its initramfs).
	System       *Part   `json:"system,omitempty"`
	SystemVerity *Part   `json:"system_verity,omitempty"`
	Verity       *Verity `json:"verity,omitempty"`
	// Packages are every package in the image with its version, sorted
	// by name (the image's SBOM).
	Packages []Package `json:"packages,omitempty"`
}

// Part names, as Parts gives them and as an image directory's files are
// named after them (see File).
const (
	PartKernel       = "kernel"
	PartInitrd       = "initrd"
	PartWorkspace    = "workspace"
	PartSystem       = "system"
	PartSystemVerity = "system_verity"
)

// Parts are the image's files, named, in a fixed order: kernel, initrd,
// then those of the workspace template, root file system and hash device
// that the image has.
func (m *Manifest) Parts() []NamedPart {
	ps := []NamedPart{{PartKernel, m.Kernel}, {PartInitrd, m.Initrd}}
	for _, p := range []struct {
		name string
		part *Part
	}{{PartWorkspace, m.Workspace}, {PartSystem, m.System}, {PartSystemVerity, m.SystemVerity}} {
		if p.part != nil {
			ps = append(ps, NamedPart{p.name, *p.part})
		}
	}
	return ps
}

// NamedPart is a Part with what it is.
type NamedPart struct {
	Name string
	Part Part
}

var (
	nameRE    = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,62}$`) })
	kernverRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._+~-]{0,63}$`) })
)

// knownArches are the Go architecture names an image may target.
var knownArches = map[string]bool{"amd64": true, "arm64": true}

// ValidName reports whether s is acceptable as an image name (and as a
// store tag): [a-z0-9][a-z0-9._-]{0,62}.
func ValidName(s string) bool { return nameRE().MatchString(s) }

// ValidateDigest returns nil if d is "sha256:" followed by 64 lower-case hex
// digits.
func ValidateDigest(d string) error {
	h, ok := strings.CutPrefix(d, DigestPrefix)
	if !ok {
		return fmt.Errorf("%w: digest %q: want prefix %q", ErrInvalid, d, DigestPrefix)
	}
	if len(h) != sha256.Size*2 {
		return fmt.Errorf("%w: digest %q: want %d hex digits", ErrInvalid, d, sha256.Size*2)
	}
	for _, c := range h {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return fmt.Errorf("%w: digest %q: not lower-case hex", ErrInvalid, d)
		}
	}
	return nil
}

// DigestBytes returns the digest of b in the form ValidateDigest accepts.
func DigestBytes(b []byte) string {
	sum := sha256.Sum256(b)
	return DigestPrefix + hex.EncodeToString(sum[:])
}

// Validate returns an error wrapping ErrInvalid naming the first bad field.
func (m *Manifest) Validate() error {
	if m.SchemaVersion != 1 && m.SchemaVersion != SchemaVersion {
		return fmt.Errorf("%w: unsupported schema_version %d (want 1 or %d)", ErrInvalid, m.SchemaVersion, SchemaVersion)
	}
	if !ValidName(m.Name) {
		return fmt.Errorf("%w: name %q: want [a-z0-9][a-z0-9._-]{0,62}", ErrInvalid, m.Name)
	}
	if !knownArches[m.Arch] {
		return fmt.Errorf("%w: unknown arch %q", ErrInvalid, m.Arch)
	}
	if !kernverRE().MatchString(m.KernelVersion) {
		return fmt.Errorf("%w: kernel_version %q", ErrInvalid, m.KernelVersion)
	}
	if err := m.Kernel.validate(); err != nil {
		return fmt.Errorf("kernel: %w", err)
	}
	if err := m.Initrd.validate(); err != nil {
		return fmt.Errorf("initrd: %w", err)
	}
	if m.Workspace != nil {
		if err := m.Workspace.validate(); err != nil {
			return fmt.Errorf("workspace: %w", err)
		}
	}
	if err := m.validateSystem(); err != nil {
		return err
	}
	if len(m.Cmdline) > MaxCmdline {
		return fmt.Errorf("%w: cmdline is %d bytes, limit %d", ErrInvalid, len(m.Cmdline), MaxCmdline)
	}
	for _, c := range m.Cmdline {
		if c < 0x20 || c == 0x7f {
			return fmt.Errorf("%w: cmdline contains control character %q", ErrInvalid, c)
		}
	}
	return nil
}

func (p Part) validate() error {
	if err := ValidateDigest(p.Digest); err != nil {
		return err
	}
	if p.Size <= 0 || p.Size > MaxPartSize {
		return fmt.Errorf("%w: size %d: want 1 to %d bytes", ErrInvalid, p.Size, int64(MaxPartSize))
	}
	return nil
}

// Marshal validates m and returns its canonical encoding, the bytes that
// Digest hashes and that a store keeps.
func (m *Manifest) Marshal() ([]byte, error) {
	if err := m.Validate(); err != nil {
		return nil, err
	}
	b, err := json.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("encode manifest: %w", err)
	}
	return b, nil
}

// Digest returns "sha256:<hex>" of the canonical encoding. It fails if m is
// invalid, so a digest always names a valid manifest.
func (m *Manifest) Digest() (string, error) {
	b, err := m.Marshal()
	if err != nil {
		return "", err
	}
	return DigestBytes(b), nil
}

// Parse decodes and validates one manifest. It rejects input larger than
// MaxSize, unknown fields, trailing data and unsupported schema versions.
// The input need not be canonical; use Marshal to get canonical bytes.
func Parse(b []byte) (*Manifest, error) {
	if len(b) > MaxSize {
		return nil, fmt.Errorf("%w: %d bytes exceeds limit of %d", ErrInvalid, len(b), MaxSize)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var m Manifest
	if err := dec.Decode(&m); err != nil {
		return nil, fmt.Errorf("%w: decode: %w", ErrInvalid, err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%w: trailing data after manifest", ErrInvalid)
	}
	if err := m.Validate(); err != nil {
		return nil, err
	}
	return &m, nil
}
