package sbom

import (
	"fmt"
	"time"

	"github.com/carrel-os/carrel/image/manifest"
)

type cdxBOM struct {
	BOMFormat    string          `json:"bomFormat"`
	SpecVersion  string          `json:"specVersion"`
	SerialNumber string          `json:"serialNumber"`
	Version      int             `json:"version"`
	Metadata     cdxMetadata     `json:"metadata"`
	Components   []cdxComponent  `json:"components"`
	Dependencies []cdxDependency `json:"dependencies"`
}

type cdxMetadata struct {
	Timestamp string       `json:"timestamp"`
	Tools     cdxTools     `json:"tools"`
	Component cdxComponent `json:"component"`
}

type cdxTools struct {
	Components []cdxComponent `json:"components"`
}

type cdxComponent struct {
	Type    string    `json:"type"`
	BOMRef  string    `json:"bom-ref,omitempty"`
	Name    string    `json:"name"`
	Version string    `json:"version,omitempty"`
	Hashes  []cdxHash `json:"hashes,omitempty"`
	PURL    string    `json:"purl,omitempty"`
}

type cdxHash struct {
	Alg     string `json:"alg"`
	Content string `json:"content"`
}

type cdxDependency struct {
	Ref       string   `json:"ref"`
	DependsOn []string `json:"dependsOn"`
}

// CycloneDX returns the SBOM of the image m, whose manifest digest is
// digest, as a CycloneDX 1.5 JSON BOM timestamped created. The image is
// the metadata component (an operating-system whose bom-ref and version
// are its digest); each manifest package is a library component whose
// bom-ref is its purl, in manifest order, and the image depends on all of
// them. The serial number is the version 5 UUID of
// "https://github.com/carrel-os/carrel/cyclonedx/<digest hex>" in the URL
// namespace. It fails if m or digest is invalid or created is zero.
func CycloneDX(m *manifest.Manifest, digest string, created time.Time) ([]byte, error) {
	hex, stamp, err := prepare(m, digest, created)
	if err != nil {
		return nil, err
	}
	bom := cdxBOM{
		BOMFormat:    "CycloneDX",
		SpecVersion:  "1.5",
		SerialNumber: "urn:uuid:" + manifest.FormatUUID(uuidV5(namespaceURL, namespaceBase+"cyclonedx/"+hex)),
		Version:      1,
		Metadata: cdxMetadata{
			Timestamp: stamp,
			Tools:     cdxTools{Components: []cdxComponent{{Type: "application", Name: toolName}}},
			Component: cdxComponent{
				Type:    "operating-system",
				BOMRef:  digest,
				Name:    m.Name,
				Version: digest,
				Hashes:  []cdxHash{{Alg: "SHA-256", Content: hex}},
			},
		},
		Components: []cdxComponent{},
	}
	refs := []string{}
	seen := map[string]bool{digest: true}
	for _, p := range m.Packages {
		purl := PURL(p)
		if seen[purl] {
			// A valid manifest's packages are unique and so are
			// their purls; a duplicate bom-ref would make the BOM
			// invalid.
			return nil, fmt.Errorf("sbom: package %q %q: duplicate bom-ref %s", p.Name, p.Version, purl)
		}
		seen[purl] = true
		bom.Components = append(bom.Components, cdxComponent{Type: "library", BOMRef: purl, Name: p.Name, Version: p.Version, PURL: purl})
		refs = append(refs, purl)
	}
	bom.Dependencies = []cdxDependency{{Ref: digest, DependsOn: refs}}
	return encode(bom)
}
