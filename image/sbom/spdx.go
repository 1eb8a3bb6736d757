package sbom

import (
	"strconv"
	"time"

	"github.com/carrel-os/carrel/image/manifest"
)

// SPDX identifiers and values this package writes.
const (
	spdxDocumentID = "SPDXRef-DOCUMENT"
	spdxImageID    = "SPDXRef-Image"
	noAssertion    = "NOASSERTION"
)

type spdxDocument struct {
	SPDXVersion       string             `json:"spdxVersion"`
	DataLicense       string             `json:"dataLicense"`
	SPDXID            string             `json:"SPDXID"`
	Name              string             `json:"name"`
	DocumentNamespace string             `json:"documentNamespace"`
	CreationInfo      spdxCreationInfo   `json:"creationInfo"`
	Packages          []spdxPackage      `json:"packages"`
	Relationships     []spdxRelationship `json:"relationships"`
}

type spdxCreationInfo struct {
	Created  string   `json:"created"`
	Creators []string `json:"creators"`
}

type spdxPackage struct {
	Name                  string            `json:"name"`
	SPDXID                string            `json:"SPDXID"`
	VersionInfo           string            `json:"versionInfo,omitempty"`
	Supplier              string            `json:"supplier,omitempty"`
	DownloadLocation      string            `json:"downloadLocation"`
	FilesAnalyzed         bool              `json:"filesAnalyzed"`
	Checksums             []spdxChecksum    `json:"checksums,omitempty"`
	PrimaryPackagePurpose string            `json:"primaryPackagePurpose,omitempty"`
	ExternalRefs          []spdxExternalRef `json:"externalRefs,omitempty"`
}

type spdxChecksum struct {
	Algorithm     string `json:"algorithm"`
	ChecksumValue string `json:"checksumValue"`
}

type spdxExternalRef struct {
	ReferenceCategory string `json:"referenceCategory"`
	ReferenceType     string `json:"referenceType"`
	ReferenceLocator  string `json:"referenceLocator"`
}

type spdxRelationship struct {
	SPDXElementID      string `json:"spdxElementId"`
	RelationshipType   string `json:"relationshipType"`
	RelatedSPDXElement string `json:"relatedSpdxElement"`
}

// SPDX returns the SBOM of the image m, whose manifest digest is digest,
// as an SPDX 2.3 JSON document created at created. The document describes
// one package for the image (SPDXRef-Image, versioned by its digest) that
// CONTAINS one package per manifest package, in manifest order, each
// with its purl. The documentNamespace is derived from the image's name and
// digest. It fails if m or digest is invalid or created is zero.
func SPDX(m *manifest.Manifest, digest string, created time.Time) ([]byte, error) {
	hex, stamp, err := prepare(m, digest, created)
	if err != nil {
		return nil, err
	}
	doc := spdxDocument{
		SPDXVersion:       "SPDX-2.3",
		DataLicense:       "CC0-1.0",
		SPDXID:            spdxDocumentID,
		Name:              m.Name,
		DocumentNamespace: namespaceBase + "spdx/" + m.Name + "-" + hex,
		CreationInfo:      spdxCreationInfo{Created: stamp, Creators: []string{"Tool: " + toolName}},
		Packages: []spdxPackage{{
			Name:                  m.Name,
			SPDXID:                spdxImageID,
			VersionInfo:           digest,
			DownloadLocation:      noAssertion,
			Checksums:             []spdxChecksum{{Algorithm: "SHA256", ChecksumValue: hex}},
			PrimaryPackagePurpose: "OPERATING-SYSTEM",
		}},
		Relationships: []spdxRelationship{{spdxDocumentID, "DESCRIBES", spdxImageID}},
	}
	for i, p := range m.Packages {
		id := spdxPackageID(i+1, p.Name)
		supplier := noAssertion
		if p.Arch != "" {
			supplier = "Organization: Debian"
		}
		doc.Packages = append(doc.Packages, spdxPackage{
			Name:             p.Name,
			SPDXID:           id,
			VersionInfo:      p.Version,
			Supplier:         supplier,
			DownloadLocation: noAssertion,
			ExternalRefs:     []spdxExternalRef{{"PACKAGE-MANAGER", "purl", PURL(p)}},
		})
		doc.Relationships = append(doc.Relationships, spdxRelationship{spdxImageID, "CONTAINS", id})
	}
	return encode(doc)
}

// spdxPackageID is "SPDXRef-Package-<n>-<name>", with every character of
// name outside SPDX's idstring set [A-Za-z0-9.-] replaced by '-'. The
// package's position n keeps IDs unique when sanitized names collide.
func spdxPackageID(n int, name string) string {
	b := []byte(name)
	for i, c := range b {
		if !isAlnum(c) && c != '.' && c != '-' {
			b[i] = '-'
		}
	}
	return "SPDXRef-Package-" + strconv.Itoa(n) + "-" + string(b)
}
