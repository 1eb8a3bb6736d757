// Package manifest defines the image manifest: the content digests of the
// parts a VM boots from, plus the kernel command line they were built for.
//
// A manifest names its parts only by digest and carries no timestamps, so the
// same inputs always give the same manifest digest.
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
)

// SchemaVersion is the only manifest schema this package reads and writes.
const SchemaVersion = 1

// MaxSize bounds an encoded manifest; Parse rejects anything larger.
const MaxSize = 64 << 10

// MaxCmdline bounds the kernel command line (x86's COMMAND_LINE_SIZE).
const MaxCmdline = 2048

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
}

// Parts are the image's files, named, in a fixed order: kernel, initrd,
// and the workspace template if the image has one.
func (m *Manifest) Parts() []NamedPart {
	ps := []NamedPart{{"kernel", m.Kernel}, {"initrd", m.Initrd}}
	if m.Workspace != nil {
		ps = append(ps, NamedPart{"workspace", *m.Workspace})
	}
	return ps
}

// NamedPart is a Part with what it is.
type NamedPart struct {
	Name string
	Part Part
}

var (
	nameRE    = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,62}$`)
	kernverRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._+~-]{0,63}$`)
)

// knownArches are the Go architecture names an image may target.
var knownArches = map[string]bool{"amd64": true, "arm64": true}

// ValidName reports whether s is acceptable as an image name (and as a
// store tag): [a-z0-9][a-z0-9._-]{0,62}.
func ValidName(s string) bool { return nameRE.MatchString(s) }

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
	if m.SchemaVersion != SchemaVersion {
		return fmt.Errorf("%w: unsupported schema_version %d (want %d)", ErrInvalid, m.SchemaVersion, SchemaVersion)
	}
	if !ValidName(m.Name) {
		return fmt.Errorf("%w: name %q: want [a-z0-9][a-z0-9._-]{0,62}", ErrInvalid, m.Name)
	}
	if !knownArches[m.Arch] {
		return fmt.Errorf("%w: unknown arch %q", ErrInvalid, m.Arch)
	}
	if !kernverRE.MatchString(m.KernelVersion) {
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
	if p.Size <= 0 {
		return fmt.Errorf("%w: size %d: want > 0", ErrInvalid, p.Size)
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
