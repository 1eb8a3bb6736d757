package sbom

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/image/manifest"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata")

var created = time.Date(2025, 3, 14, 15, 9, 26, 0, time.UTC)

// testManifest is a valid manifest with pkgs, and its digest.
func testManifest(t *testing.T, pkgs ...manifest.Package) (*manifest.Manifest, string) {
	t.Helper()
	m := &manifest.Manifest{
		SchemaVersion: manifest.SchemaVersion,
		Name:          "agent",
		Arch:          "amd64",
		KernelVersion: "6.1.0-56-amd64",
		Kernel:        manifest.Part{Digest: manifest.DigestBytes([]byte("kernel")), Size: 6},
		Initrd:        manifest.Part{Digest: manifest.DigestBytes([]byte("initrd")), Size: 6},
		Cmdline:       "console=ttyS0 quiet panic=-1",
		Packages:      pkgs,
	}
	d, err := m.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return m, d
}

// tiny has a Debian package with an epoch and a '+', a Nix store path
// whose name needs escaping, and a Debian package with '+' in its name.
var tiny = []manifest.Package{
	{Name: "bash", Version: "1:5.2.15-2+b7", Arch: "amd64"},
	{Name: "gtk+3", Version: "3.24.41"},
	{Name: "libstdc++6", Version: "12.2.0-14", Arch: "amd64"},
}

var formats = []struct {
	name string
	fn   func(*manifest.Manifest, string, time.Time) ([]byte, error)
}{
	{"spdx", SPDX},
	{"cyclonedx", CycloneDX},
}

func TestGolden(t *testing.T) {
	m, d := testManifest(t, tiny...)
	for _, f := range formats {
		t.Run(f.name, func(t *testing.T) {
			got, err := f.fn(m, d, created)
			if err != nil {
				t.Fatal(err)
			}
			path := filepath.Join("testdata", f.name+".golden.json")
			if *update {
				if err := os.WriteFile(path, got, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("%v (run go test -update to write it)", err)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("output differs from %s (go test -update rewrites it):\n%s", path, got)
			}
		})
	}
}

func TestDeterministic(t *testing.T) {
	m, d := testManifest(t, tiny...)
	// The same instant in another zone, with sub-second noise, is the
	// same document.
	other := created.Add(999 * time.Millisecond).In(time.FixedZone("X", 5*3600))
	for _, f := range formats {
		a, err := f.fn(m, d, created)
		if err != nil {
			t.Fatal(err)
		}
		b, err := f.fn(m, d, other)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(a, b) {
			t.Errorf("%s: two exports differ:\n%s\n%s", f.name, a, b)
		}
		if !bytes.HasSuffix(a, []byte("}\n")) || !bytes.Contains(a, []byte("\n  \"")) {
			t.Errorf("%s: want two-space indent and a trailing newline:\n%s", f.name, a)
		}
		if !bytes.Contains(a, []byte(`"2025-03-14T15:09:26Z"`)) {
			t.Errorf("%s: no RFC 3339 UTC timestamp:\n%s", f.name, a)
		}
	}
	// A different image gets different identifiers.
	m2, d2 := testManifest(t, tiny[:1]...)
	s1, _ := decodeSPDX(t, m, d)
	s2, _ := decodeSPDX(t, m2, d2)
	c1, _ := decodeCDX(t, m, d)
	c2, _ := decodeCDX(t, m2, d2)
	if s1.DocumentNamespace == s2.DocumentNamespace || c1.SerialNumber == c2.SerialNumber {
		t.Errorf("two images share identifiers: %s %s", s1.DocumentNamespace, c1.SerialNumber)
	}
}

func TestPURL(t *testing.T) {
	for _, c := range []struct {
		p    manifest.Package
		want string
	}{
		{manifest.Package{Name: "foo", Version: "1:2.3+dfsg-1", Arch: "amd64"}, "pkg:deb/debian/foo@1%3A2.3%2Bdfsg-1?arch=amd64"},
		{manifest.Package{Name: "libstdc++6", Version: "12.2.0-14", Arch: "arm64"}, "pkg:deb/debian/libstdc%2B%2B6@12.2.0-14?arch=arm64"},
		{manifest.Package{Name: "tzdata", Version: "2024a-0+deb12u1", Arch: "all"}, "pkg:deb/debian/tzdata@2024a-0%2Bdeb12u1?arch=all"},
		{manifest.Package{Name: "libc6", Version: "", Arch: "amd64"}, "pkg:deb/debian/libc6?arch=amd64"},
		{manifest.Package{Name: "coreutils", Version: "9.5"}, "pkg:nix/coreutils@9.5"},
		{manifest.Package{Name: "nixos-system-agent", Version: ""}, "pkg:nix/nixos-system-agent"},
		{manifest.Package{Name: "a/b%c@d?e#f", Version: "1~rc_1"}, "pkg:nix/a%2Fb%25c%40d%3Fe%23f@1~rc_1"},
	} {
		if got := PURL(c.p); got != c.want {
			t.Errorf("PURL(%+v) = %q, want %q", c.p, got, c.want)
		}
	}
}

type spdxDoc struct {
	SPDXVersion       string `json:"spdxVersion"`
	DataLicense       string `json:"dataLicense"`
	SPDXID            string `json:"SPDXID"`
	Name              string `json:"name"`
	DocumentNamespace string `json:"documentNamespace"`
	CreationInfo      struct {
		Created  string   `json:"created"`
		Creators []string `json:"creators"`
	} `json:"creationInfo"`
	Packages []struct {
		Name                  string `json:"name"`
		SPDXID                string `json:"SPDXID"`
		VersionInfo           string `json:"versionInfo"`
		Supplier              string `json:"supplier"`
		DownloadLocation      string `json:"downloadLocation"`
		FilesAnalyzed         *bool  `json:"filesAnalyzed"`
		PrimaryPackagePurpose string `json:"primaryPackagePurpose"`
		Checksums             []struct {
			Algorithm     string `json:"algorithm"`
			ChecksumValue string `json:"checksumValue"`
		} `json:"checksums"`
		ExternalRefs []struct {
			ReferenceCategory string `json:"referenceCategory"`
			ReferenceType     string `json:"referenceType"`
			ReferenceLocator  string `json:"referenceLocator"`
		} `json:"externalRefs"`
	} `json:"packages"`
	Relationships []struct {
		SPDXElementID      string `json:"spdxElementId"`
		RelationshipType   string `json:"relationshipType"`
		RelatedSPDXElement string `json:"relatedSpdxElement"`
	} `json:"relationships"`
}

func decodeSPDX(t *testing.T, m *manifest.Manifest, d string) (spdxDoc, []byte) {
	t.Helper()
	b, err := SPDX(m, d, created)
	if err != nil {
		t.Fatal(err)
	}
	var doc spdxDoc
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&doc); err != nil {
		t.Fatalf("decode SPDX: %v\n%s", err, b)
	}
	return doc, b
}

var spdxIDRE = regexp.MustCompile(`^SPDXRef-[A-Za-z0-9.-]+$`)

func TestSPDXStructure(t *testing.T) {
	pkgs := append(tiny[:len(tiny):len(tiny)],
		// Sanitized, these names collide; their IDs must not.
		manifest.Package{Name: "x+y", Version: "1"},
		manifest.Package{Name: "x-y", Version: "1"},
		manifest.Package{Name: "x_y", Version: "1", Arch: "amd64"},
	)
	m, d := testManifest(t, manifest.SortPackages(pkgs)...)
	doc, _ := decodeSPDX(t, m, d)
	hex := strings.TrimPrefix(d, "sha256:")
	if doc.SPDXVersion != "SPDX-2.3" || doc.DataLicense != "CC0-1.0" || doc.SPDXID != "SPDXRef-DOCUMENT" || doc.Name != "agent" ||
		doc.DocumentNamespace != "https://github.com/carrel-os/carrel/spdx/agent-"+hex ||
		doc.CreationInfo.Created != "2025-03-14T15:09:26Z" || len(doc.CreationInfo.Creators) != 1 || doc.CreationInfo.Creators[0] != "Tool: carrel" {
		t.Errorf("document header: %+v", doc)
	}
	if len(doc.Packages) != len(m.Packages)+1 {
		t.Fatalf("%d packages, want %d", len(doc.Packages), len(m.Packages)+1)
	}
	img := doc.Packages[0]
	if img.SPDXID != "SPDXRef-Image" || img.Name != "agent" || img.VersionInfo != d || img.DownloadLocation != "NOASSERTION" ||
		img.FilesAnalyzed == nil || *img.FilesAnalyzed || img.PrimaryPackagePurpose != "OPERATING-SYSTEM" ||
		len(img.Checksums) != 1 || img.Checksums[0].Algorithm != "SHA256" || img.Checksums[0].ChecksumValue != hex {
		t.Errorf("image package: %+v", img)
	}
	ids := map[string]bool{"SPDXRef-DOCUMENT": true}
	for i, p := range doc.Packages {
		if !spdxIDRE.MatchString(p.SPDXID) {
			t.Errorf("package %q: invalid SPDXID %q", p.Name, p.SPDXID)
		}
		if ids[p.SPDXID] {
			t.Errorf("duplicate SPDXID %q", p.SPDXID)
		}
		ids[p.SPDXID] = true
		if i == 0 {
			continue
		}
		mp := m.Packages[i-1]
		wantSupplier := "NOASSERTION"
		if mp.Arch != "" {
			wantSupplier = "Organization: Debian"
		}
		if p.Name != mp.Name || p.VersionInfo != mp.Version || p.Supplier != wantSupplier || p.DownloadLocation != "NOASSERTION" ||
			p.FilesAnalyzed == nil || *p.FilesAnalyzed || len(p.ExternalRefs) != 1 ||
			p.ExternalRefs[0] != (struct {
				ReferenceCategory string `json:"referenceCategory"`
				ReferenceType     string `json:"referenceType"`
				ReferenceLocator  string `json:"referenceLocator"`
			}{"PACKAGE-MANAGER", "purl", PURL(mp)}) {
			t.Errorf("package %d: %+v, want %+v", i, p, mp)
		}
	}
	if len(doc.Relationships) != len(m.Packages)+1 {
		t.Fatalf("%d relationships", len(doc.Relationships))
	}
	r := doc.Relationships[0]
	if r.SPDXElementID != "SPDXRef-DOCUMENT" || r.RelationshipType != "DESCRIBES" || r.RelatedSPDXElement != "SPDXRef-Image" {
		t.Errorf("first relationship %+v", r)
	}
	for i, r := range doc.Relationships[1:] {
		if r.SPDXElementID != "SPDXRef-Image" || r.RelationshipType != "CONTAINS" || r.RelatedSPDXElement != doc.Packages[i+1].SPDXID {
			t.Errorf("relationship %d: %+v", i+1, r)
		}
	}
}

type cdxDoc struct {
	BOMFormat    string `json:"bomFormat"`
	SpecVersion  string `json:"specVersion"`
	SerialNumber string `json:"serialNumber"`
	Version      int    `json:"version"`
	Metadata     struct {
		Timestamp string `json:"timestamp"`
		Tools     struct {
			Components []cdxComp `json:"components"`
		} `json:"tools"`
		Component cdxComp `json:"component"`
	} `json:"metadata"`
	Components   []cdxComp `json:"components"`
	Dependencies []struct {
		Ref       string   `json:"ref"`
		DependsOn []string `json:"dependsOn"`
	} `json:"dependencies"`
}

type cdxComp struct {
	Type    string `json:"type"`
	BOMRef  string `json:"bom-ref"`
	Name    string `json:"name"`
	Version string `json:"version"`
	PURL    string `json:"purl"`
	Hashes  []struct {
		Alg     string `json:"alg"`
		Content string `json:"content"`
	} `json:"hashes"`
}

func decodeCDX(t *testing.T, m *manifest.Manifest, d string) (cdxDoc, []byte) {
	t.Helper()
	b, err := CycloneDX(m, d, created)
	if err != nil {
		t.Fatal(err)
	}
	var doc cdxDoc
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&doc); err != nil {
		t.Fatalf("decode CycloneDX: %v\n%s", err, b)
	}
	return doc, b
}

// serialRE is the serialNumber pattern of the CycloneDX 1.5 JSON schema.
var serialRE = regexp.MustCompile(`^urn:uuid:[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[1-5][0-9a-fA-F]{3}-[89abAB][0-9a-fA-F]{3}-[0-9a-fA-F]{12}$`)

func TestCycloneDXStructure(t *testing.T) {
	m, d := testManifest(t, tiny...)
	doc, _ := decodeCDX(t, m, d)
	hex := strings.TrimPrefix(d, "sha256:")
	if doc.BOMFormat != "CycloneDX" || doc.SpecVersion != "1.5" || !serialRE.MatchString(doc.SerialNumber) || doc.Version != 1 ||
		doc.Metadata.Timestamp != "2025-03-14T15:09:26Z" {
		t.Errorf("BOM header: %+v", doc)
	}
	if tc := doc.Metadata.Tools.Components; len(tc) != 1 || tc[0].Type != "application" || tc[0].Name != "carrel" {
		t.Errorf("tools: %+v", tc)
	}
	c := doc.Metadata.Component
	if c.Type != "operating-system" || c.BOMRef != d || c.Name != "agent" || c.Version != d ||
		len(c.Hashes) != 1 || c.Hashes[0].Alg != "SHA-256" || c.Hashes[0].Content != hex {
		t.Errorf("metadata component: %+v", c)
	}
	if len(doc.Components) != len(m.Packages) {
		t.Fatalf("%d components, want %d", len(doc.Components), len(m.Packages))
	}
	refs := map[string]bool{d: true}
	for i, c := range doc.Components {
		p := m.Packages[i]
		if c.Type != "library" || c.Name != p.Name || c.Version != p.Version || c.PURL != PURL(p) || c.BOMRef != c.PURL {
			t.Errorf("component %d: %+v, want %+v", i, c, p)
		}
		if refs[c.BOMRef] {
			t.Errorf("duplicate bom-ref %q", c.BOMRef)
		}
		refs[c.BOMRef] = true
	}
	if len(doc.Dependencies) != 1 || doc.Dependencies[0].Ref != d || len(doc.Dependencies[0].DependsOn) != len(m.Packages) {
		t.Fatalf("dependencies: %+v", doc.Dependencies)
	}
	for i, r := range doc.Dependencies[0].DependsOn {
		if r != doc.Components[i].BOMRef {
			t.Errorf("dependsOn[%d] = %q, want %q", i, r, doc.Components[i].BOMRef)
		}
	}
}

func TestNoPackages(t *testing.T) {
	m, d := testManifest(t)
	s, sb := decodeSPDX(t, m, d)
	if len(s.Packages) != 1 || len(s.Relationships) != 1 {
		t.Errorf("SPDX of an image without packages:\n%s", sb)
	}
	c, cb := decodeCDX(t, m, d)
	if len(c.Components) != 0 || len(c.Dependencies) != 1 || !bytes.Contains(cb, []byte(`"components": []`)) ||
		!bytes.Contains(cb, []byte(`"dependsOn": []`)) {
		t.Errorf("CycloneDX of an image without packages:\n%s", cb)
	}
}

func TestNixPackages(t *testing.T) {
	m, d := testManifest(t,
		manifest.Package{Name: "bash-interactive", Version: "5.2p37"},
		manifest.Package{Name: "nixos-system-agent", Version: ""},
	)
	s, sb := decodeSPDX(t, m, d)
	if p := s.Packages[2]; p.Supplier != "NOASSERTION" || p.VersionInfo != "" || p.ExternalRefs[0].ReferenceLocator != "pkg:nix/nixos-system-agent" ||
		bytes.Contains(sb, []byte(`"versionInfo": ""`)) {
		t.Errorf("SPDX of Nix packages:\n%s", sb)
	}
	c, cb := decodeCDX(t, m, d)
	if c.Components[0].PURL != "pkg:nix/bash-interactive@5.2p37" || c.Components[1].BOMRef != "pkg:nix/nixos-system-agent" ||
		bytes.Contains(cb, []byte(`"version": ""`)) {
		t.Errorf("CycloneDX of Nix packages:\n%s", cb)
	}
}

func TestRejects(t *testing.T) {
	m, d := testManifest(t, tiny...)
	unsorted, _ := testManifest(t)
	unsorted.Packages = []manifest.Package{tiny[1], tiny[0]}
	for _, c := range []struct {
		name    string
		m       *manifest.Manifest
		digest  string
		created time.Time
	}{
		{"nil manifest", nil, d, created},
		{"invalid manifest", unsorted, d, created},
		{"bad digest", m, "sha256:abc", created},
		{"digest without prefix", m, strings.TrimPrefix(d, "sha256:"), created},
		{"zero time", m, d, time.Time{}},
	} {
		for _, f := range formats {
			if b, err := f.fn(c.m, c.digest, c.created); err == nil {
				t.Errorf("%s %s: no error, got\n%s", f.name, c.name, b)
			}
		}
	}
}

func TestUUIDv5(t *testing.T) {
	// Python: uuid.uuid5(uuid.NAMESPACE_DNS, "python.org").
	dns := [16]byte{0x6b, 0xa7, 0xb8, 0x10, 0x9d, 0xad, 0x11, 0xd1, 0x80, 0xb4, 0x00, 0xc0, 0x4f, 0xd4, 0x30, 0xc8}
	if got := manifest.FormatUUID(uuidV5(dns, "python.org")); got != "886313e1-3b8a-5372-9b90-0c9aee199e5d" {
		t.Errorf("uuidV5 = %s", got)
	}
}
