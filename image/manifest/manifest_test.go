package manifest

import (
	"errors"
	"reflect"
	"strings"
	"testing"
)

func valid() *Manifest {
	return &Manifest{
		SchemaVersion: SchemaVersion,
		Name:          "carrel-dev",
		Arch:          "amd64",
		KernelVersion: "6.1.0-56-amd64",
		Kernel:        Part{Digest: DigestBytes([]byte("kernel")), Size: 6},
		Initrd:        Part{Digest: DigestBytes([]byte("initrd")), Size: 6},
		Cmdline:       "console=ttyS0 quiet panic=-1",
	}
}

func TestRoundTripAndDigestStable(t *testing.T) {
	m := valid()
	b, err := m.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	d1, err := m.Digest()
	if err != nil {
		t.Fatal(err)
	}
	if d1 != DigestBytes(b) {
		t.Fatalf("Digest %s != digest of Marshal %s", d1, DigestBytes(b))
	}
	if err := ValidateDigest(d1); err != nil {
		t.Fatal(err)
	}
	got, err := Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, m) {
		t.Fatalf("round trip: got %+v want %+v", got, m)
	}
	d2, err := got.Digest()
	if err != nil || d2 != d1 {
		t.Fatalf("digest after round trip = %s, %v; want %s", d2, err, d1)
	}
	want := `{"schema_version":2,"name":"carrel-dev","arch":"amd64","kernel_version":"6.1.0-56-amd64",` +
		`"kernel":{"digest":"` + m.Kernel.Digest + `","size":6},"initrd":{"digest":"` + m.Initrd.Digest + `","size":6},` +
		`"cmdline":"console=ttyS0 quiet panic=-1"}`
	if string(b) != want {
		t.Fatalf("canonical encoding changed:\n got %s\nwant %s", b, want)
	}
}

func TestValidateDigest(t *testing.T) {
	good := DigestBytes(nil)
	for _, d := range []string{
		"",
		"sha256:",
		strings.TrimPrefix(good, DigestPrefix),
		"sha512:" + strings.TrimPrefix(good, DigestPrefix),
		good[:len(good)-1],
		good + "0",
		strings.ToUpper(good[:7]) + good[7:],
		DigestPrefix + strings.ToUpper(strings.TrimPrefix(good, DigestPrefix)),
		good[:len(good)-1] + "g",
	} {
		if err := ValidateDigest(d); !errors.Is(err, ErrInvalid) {
			t.Errorf("ValidateDigest(%q) = %v, want ErrInvalid", d, err)
		}
	}
	if err := ValidateDigest(good); err != nil {
		t.Errorf("ValidateDigest(%q) = %v", good, err)
	}
}

func TestValidateRejects(t *testing.T) {
	cases := map[string]func(m *Manifest){
		"schema":         func(m *Manifest) { m.SchemaVersion = 3 },
		"empty name":     func(m *Manifest) { m.Name = "" },
		"upper name":     func(m *Manifest) { m.Name = "Dev" },
		"slash name":     func(m *Manifest) { m.Name = "a/b" },
		"arch":           func(m *Manifest) { m.Arch = "x86_64" },
		"kernel version": func(m *Manifest) { m.KernelVersion = "6.1/../x" },
		"kernel digest":  func(m *Manifest) { m.Kernel.Digest = "sha256:abc" },
		"initrd digest":  func(m *Manifest) { m.Initrd.Digest = "" },
		"kernel size":    func(m *Manifest) { m.Kernel.Size = 0 },
		"initrd size":    func(m *Manifest) { m.Initrd.Size = -1 },
		"cmdline ctrl":   func(m *Manifest) { m.Cmdline = "a\nb" },
		"cmdline long":   func(m *Manifest) { m.Cmdline = strings.Repeat("a", MaxCmdline+1) },
	}
	for name, mutate := range cases {
		t.Run(name, func(t *testing.T) {
			m := valid()
			mutate(m)
			if err := m.Validate(); !errors.Is(err, ErrInvalid) {
				t.Fatalf("Validate = %v, want ErrInvalid", err)
			}
			if _, err := m.Digest(); err == nil {
				t.Fatal("Digest of invalid manifest succeeded")
			}
		})
	}
}

func TestParseRejects(t *testing.T) {
	b, err := valid().Marshal()
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	cases := map[string]string{
		"empty":          "",
		"not json":       "manifest",
		"unknown field":  strings.Replace(s, `"name"`, `"extra":1,"name"`, 1),
		"trailing data":  s + "{}",
		"trailing brace": s + "}",
		"bad digest":     strings.Replace(s, "sha256:", "sha1:", 1),
		"wrong type":     strings.Replace(s, `"size":6`, `"size":"6"`, 1),
		"oversize":       s[:len(s)-1] + `,"cmdline":"` + strings.Repeat(" ", MaxSize) + `"}`,
		"schema 0":       strings.Replace(s, `"schema_version":2`, `"schema_version":0`, 1),
	}
	for name, in := range cases {
		t.Run(name, func(t *testing.T) {
			if _, err := Parse([]byte(in)); !errors.Is(err, ErrInvalid) {
				t.Fatalf("Parse = %v, want ErrInvalid", err)
			}
		})
	}
}

func FuzzParse(f *testing.F) {
	b, _ := valid().Marshal()
	f.Add(b)
	sys, _ := validSystem(f).Marshal()
	f.Add(sys)
	f.Add([]byte(`{}`))
	f.Fuzz(func(t *testing.T, in []byte) {
		m, err := Parse(in)
		if err != nil {
			return
		}
		if _, err := m.Digest(); err != nil {
			t.Fatalf("parsed manifest has no digest: %v", err)
		}
	})
}

func TestWorkspacePart(t *testing.T) {
	m := valid()
	m.Workspace = &Part{Digest: DigestBytes([]byte("ext4")), Size: 16 << 20}
	b, err := m.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(string(b), `,"workspace":{"digest":"`+m.Workspace.Digest+`","size":16777216}}`) {
		t.Errorf("encoding: %s", b)
	}
	got, err := Parse(b)
	if err != nil || got.Workspace == nil || *got.Workspace != *m.Workspace {
		t.Fatalf("round trip: %+v, %v", got, err)
	}
	ps := got.Parts()
	if len(ps) != 3 || ps[0].Name != "kernel" || ps[1].Name != "initrd" || ps[2].Name != "workspace" || ps[2].Part != *m.Workspace {
		t.Errorf("parts %+v", ps)
	}
	if n := len(valid().Parts()); n != 2 {
		t.Errorf("an image without a workspace template has %d parts", n)
	}
	m.Workspace.Size = 0
	if err := m.Validate(); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "workspace") {
		t.Errorf("empty workspace template: %v", err)
	}
}
