// Package sbom writes an image's software bill of materials, the package
// list of its manifest, as SPDX 2.3 or CycloneDX 1.5 JSON.
//
// The output depends only on its inputs: identifiers are derived from the
// manifest digest, never drawn at random, and everything is in the
// manifest's (sorted) package order, so exporting the same image twice
// gives the same bytes.
package sbom

import (
	"bytes"
	"crypto/sha1"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/carrel-os/carrel/image/manifest"
)

// namespaceBase prefixes the SPDX documentNamespace and names the
// CycloneDX serial number's UUID.
const namespaceBase = "https://github.com/carrel-os/carrel/"

// toolName is the creator both formats name.
const toolName = "carrel"

// prepare checks the inputs both formats share and returns the digest's
// hex and the creation time as RFC 3339 UTC, in whole seconds.
func prepare(m *manifest.Manifest, digest string, created time.Time) (hex, stamp string, err error) {
	if m == nil {
		return "", "", errors.New("sbom: no manifest")
	}
	if err := m.Validate(); err != nil {
		return "", "", fmt.Errorf("sbom: %w", err)
	}
	if err := manifest.ValidateDigest(digest); err != nil {
		return "", "", fmt.Errorf("sbom: %w", err)
	}
	if created.IsZero() {
		return "", "", errors.New("sbom: creation time is not set")
	}
	return strings.TrimPrefix(digest, manifest.DigestPrefix), created.UTC().Truncate(time.Second).Format(time.RFC3339), nil
}

// PURL returns the package URL of p: pkg:deb/debian/NAME@VERSION?arch=ARCH
// for a Debian package (one with an Arch), pkg:nix/NAME@VERSION otherwise.
// @VERSION is left out when the version is empty. Name, version and arch
// are percent-encoded as the purl spec asks (":" and "+" become %3A, %2B).
func PURL(p manifest.Package) string {
	var b strings.Builder
	if p.Arch != "" {
		b.WriteString("pkg:deb/debian/")
	} else {
		b.WriteString("pkg:nix/")
	}
	b.WriteString(escape(p.Name))
	if p.Version != "" {
		b.WriteString("@" + escape(p.Version))
	}
	if p.Arch != "" {
		b.WriteString("?arch=" + escape(p.Arch))
	}
	return b.String()
}

// escape percent-encodes every byte but the URI unreserved characters
// (A-Z a-z 0-9 . - _ ~). It is injective, so distinct packages keep
// distinct purls.
func escape(s string) string {
	const hexDigits = "0123456789ABCDEF"
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if isAlnum(c) || c == '.' || c == '-' || c == '_' || c == '~' {
			b.WriteByte(c)
			continue
		}
		b.WriteByte('%')
		b.WriteByte(hexDigits[c>>4])
		b.WriteByte(hexDigits[c&0xf])
	}
	return b.String()
}

func isAlnum(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

// uuidV5 is the RFC 9562 name-based (SHA-1) UUID of name in namespace ns.
// CycloneDX's schema accepts only UUID versions 1 to 5, so a SHA-256 based
// version 8 UUID would not do.
func uuidV5(ns [16]byte, name string) [16]byte {
	h := sha1.New()
	h.Write(ns[:])
	h.Write([]byte(name))
	var u [16]byte
	copy(u[:], h.Sum(nil))
	u[6] = u[6]&0x0f | 0x50
	u[8] = u[8]&0x3f | 0x80
	return u
}

// namespaceURL is RFC 9562's namespace for names that are URLs.
var namespaceURL = [16]byte{0x6b, 0xa7, 0xb8, 0x11, 0x9d, 0xad, 0x11, 0xd1, 0x80, 0xb4, 0x00, 0xc0, 0x4f, 0xd4, 0x30, 0xc8}

// encode writes v as JSON indented by two spaces, with a trailing newline
// and without HTML escaping (package names may hold '<', '>' or '&').
func encode(v any) ([]byte, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return nil, fmt.Errorf("sbom: encode: %w", err)
	}
	return b.Bytes(), nil
}
