package review

import (
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/supervisor/audit"
)

// TestSummaryImage: a lifecycle record's summary names the image and a
// short root hash, with what a record holds cleaned.
func TestSummaryImage(t *testing.T) {
	digest := "sha256:" + strings.Repeat("34", 32)
	for _, c := range []struct{ data, want string }{
		{`{"event":"starting","image_digest":"` + digest + `","image_name":"agent","root_hash":"` + testRootHash + `","policy":"default","policy_revision":"r1"}`,
			"starting, image agent sha256:343434343434…, root hash bc1b8827daf7…, policy default@r1"},
		{`{"event":"started","image_digest":"` + digest + `","policy":"default"}`, "started, image sha256:343434343434…, policy default"},
		{`{"event":"stopped","reason":"asked"}`, "stopped, reason: asked"},
		{`{"event":"starting","image_digest":"x\u001b[2J","image_name":"a\u202eb","root_hash":"\u001b]0;t\u0007"}`,
			`starting, image a\u202eb x\x1b[2J, root hash \x1b]0;t\a`},
	} {
		e := &Entry{Record: audit.Record{Kind: audit.KindVMLifecycle, Provenance: audit.Host, Data: []byte(c.data)}}
		if got := Summary(e); got != c.want {
			t.Errorf("summary of %s:\n got %q\nwant %q", c.data, got, c.want)
		}
	}
}

func TestLoadImage(t *testing.T) {
	s := newSampleLog(t)
	r, sess := loadSample(t, s)
	img := LoadImage(r, sess)
	want := &Image{Seq: s.startingSeq, Name: "agent", Digest: testImage, RootHash: testRootHash, ManifestRead: true,
		KernelVersion: "6.1.0-28-amd64", Arch: "amd64", Packages: testPackages}
	if !reflect.DeepEqual(img, want) {
		t.Errorf("image %+v\nwant  %+v", img, want)
	}

	dir, _ := newExecLog(t, []string{"true"})
	r = openReader(t, dir)
	sess, err := LoadSession(r, testSession)
	if err != nil {
		t.Fatal(err)
	}
	if img := LoadImage(r, sess); img != nil {
		t.Errorf("a session whose records name no image: %+v", img)
	}
}

// TestReadImageProblems: a manifest that cannot be shown is said so, and
// never fails the review.
func TestReadImageProblems(t *testing.T) {
	other, otherDigest := sampleManifest([]manifest.Package{{Name: "zsh", Version: "5.9-4"}})
	garbage := []byte(`{"schema_version":2,"name":"<script>"}`)
	lifecycle := func(seq uint64, event, digest string, extra string, blobs ...string) Entry {
		data := fmt.Sprintf(`{"event":%q,"image_digest":%q%s}`, event, digest, extra)
		return Entry{Record: audit.Record{Seq: seq, Kind: audit.KindVMLifecycle, Blobs: blobs, Data: []byte(data)}}
	}
	blobs := func(m map[string][]byte) blobFunc {
		return func(d string) ([]byte, error) {
			if b, ok := m[d]; ok {
				return b, nil
			}
			return nil, fs.ErrNotExist
		}
	}
	for _, c := range []struct {
		name    string
		entries []Entry
		blobs   map[string][]byte
		want    string // in a problem; "" for none
		read    bool
	}{
		{"no manifest kept", []Entry{lifecycle(3, "started", testImage, "")}, nil, "record 3 keeps no copy of the image's manifest", false},
		{"missing", []Entry{lifecycle(3, "starting", testImage, "", testImage)}, nil, "(blob " + testImage + ", record 3) is missing", false},
		{"replaced", []Entry{lifecycle(3, "starting", testImage, "", testImage)}, map[string][]byte{testImage: other},
			"was replaced: its content hashes to " + otherDigest, false},
		{"not a manifest", []Entry{lifecycle(3, "starting", manifest.DigestBytes(garbage), "", manifest.DigestBytes(garbage))},
			map[string][]byte{manifest.DigestBytes(garbage): garbage}, "is not a manifest this carrel can read: invalid image manifest", false},
		{"the record disagrees", []Entry{lifecycle(3, "starting", testImage, `,"image_name":"other","root_hash":"00ff"`, testImage)},
			map[string][]byte{testImage: testManifest}, `record 3 says image name "other", the image's manifest "agent"`, true},
		{"the first created or starting record", []Entry{lifecycle(2, "started", otherDigest, ""), lifecycle(5, "starting", testImage, "", testImage),
			lifecycle(7, "starting", otherDigest, "", otherDigest)}, map[string][]byte{testImage: testManifest, otherDigest: other}, "", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			img := readImage(c.entries, blobs(c.blobs))
			if img == nil {
				t.Fatal("no image")
			}
			if img.ManifestRead != c.read || c.read != (len(img.Packages) > 0) {
				t.Errorf("read %v with %d packages, want read %v", img.ManifestRead, len(img.Packages), c.read)
			}
			got := strings.Join(img.Problems, "\n")
			if c.want == "" && got != "" || !strings.Contains(got, c.want) {
				t.Errorf("problems %q, want %q", got, c.want)
			}
			if c.read && img.Digest != testImage {
				t.Errorf("read from record %d, %s", img.Seq, img.Digest)
			}
		})
	}
	big := bytes.Repeat([]byte(" "), manifest.MaxSize+1)
	dir := t.TempDir()
	l, err := audit.Open(dir, audit.Options{Logger: quiet, CheckpointInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	w := &writer{t: t, l: l, ctx: context.Background()}
	d := w.blob(big)
	w.append(audit.Record{Kind: audit.KindVMLifecycle, VM: testVM, Session: testSession, Blobs: []string{d},
		Data: w.data(map[string]any{"event": "starting", "image_digest": d})})
	l.Close()
	r := openReader(t, dir)
	sess, err := LoadSession(r, testSession)
	if err != nil {
		t.Fatal(err)
	}
	if img := LoadImage(r, sess); len(img.Problems) != 1 || !strings.Contains(img.Problems[0], "larger than a manifest can be") {
		t.Errorf("too large: %+v", img.Problems)
	}
}

func TestReportImage(t *testing.T) {
	s := newSampleLog(t)
	page := pageWithoutPlayer(writeSampleReport(t, s, ReportOptions{}))
	for _, want := range []string{
		"<h2>Image</h2>",
		`<dt>Image</dt><dd class="mono">agent ` + testImage + `</dd>`,
		`<dt>Name</dt><dd class="mono">agent</dd>`,
		`<dt>Digest</dt><dd class="mono">` + testImage + `</dd>`,
		`<dt>Root hash</dt><dd class="mono">` + testRootHash + `</dd>`,
		`<dt>Kernel</dt><dd class="mono">6.1.0-28-amd64</dd>`,
		`<dt>Packages</dt><dd>3</dd>`,
		`<tr><td class="mono">bash</td><td class="mono">5.2.15-2&#43;b7</td><td class="mono">amd64</td></tr>`,
		`<tr><td class="mono">python3.11</td><td class="mono">3.11.2-6</td><td class="mono">amd64</td></tr>`,
	} {
		if !strings.Contains(page, want) {
			t.Errorf("the report lacks %q", want)
		}
	}
	if strings.Contains(page, "leaves out") {
		t.Error("the report says packages are left out")
	}

	page = pageWithoutPlayer(writeSampleReport(t, s, ReportOptions{MaxPackages: 2}))
	if !strings.Contains(page, "lists the first 2 of the image's 3 packages and leaves out 1") || strings.Contains(page, "python3.11") {
		t.Error("the package list is not cut at 2, or does not say so")
	}

	for _, c := range []struct {
		name string
		edit func(path string)
		want string
	}{
		{"missing", func(path string) { os.Remove(path) }, "is missing, so its packages are not known here"},
		{"replaced", func(path string) {
			os.Chmod(path, 0o600)
			os.WriteFile(path, bytes.Replace(testManifest, []byte("coreutils"), []byte("coreutilz"), 1), 0o600)
		}, "was replaced: its content hashes to sha256:"},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := newSampleLog(t)
			path, _ := audit.BlobPath(s.dir, testImage)
			c.edit(path)
			page := pageWithoutPlayer(writeSampleReport(t, s, ReportOptions{}))
			for _, want := range []string{"Integrity NOT established", "<h2>Image</h2>", `<dt>Name</dt><dd class="mono">agent</dd>`,
				`<dt>Root hash</dt><dd class="mono">` + testRootHash + `</dd>`, c.want} {
				if !strings.Contains(page, want) {
					t.Errorf("the report lacks %q", want)
				}
			}
			if strings.Contains(page, "coreutil") || strings.Contains(page, "<dt>Kernel</dt>") {
				t.Error("the report shows the content of a manifest it could not trust")
			}
		})
	}
}

// TestBundleImage: the image and its packages come through an export,
// read from the bundle alone.
func TestBundleImage(t *testing.T) {
	s := newSampleLog(t)
	b, _ := exportSample(t, s)
	key := logKey(t, s.dir)
	rep := verifyBundle(t, b, key)
	want := &Image{Seq: s.startingSeq, Name: "agent", Digest: testImage, RootHash: testRootHash, ManifestRead: true,
		KernelVersion: "6.1.0-28-amd64", Arch: "amd64", Packages: testPackages}
	if !rep.OK() || !reflect.DeepEqual(rep.Image, want) {
		t.Errorf("image %+v, problems %v", rep.Image, rep.Problems)
	}

	blob := "blobs/sha256/" + strings.TrimPrefix(testImage, "sha256:")
	for _, c := range []struct {
		name string
		edit func(tarFiles) tarFiles
		want string
	}{
		{"replaced", func(fs tarFiles) tarFiles {
			m, _ := sampleManifest([]manifest.Package{{Name: "bash", Version: "9"}})
			return fs.set(blob, m)
		}, "was replaced"},
		{"missing", func(fs tarFiles) tarFiles { return fs.drop(blob) }, "is missing"},
		{"before its record", func(fs tarFiles) tarFiles {
			m, _ := fs.get(blob)
			return append(tarFiles{{blob, m}}, fs.drop(blob)...)
		}, "it was not kept from the bundle"},
	} {
		t.Run(c.name, func(t *testing.T) {
			rep := verifyBundle(t, c.edit(untar(t, b)).tar(t), key)
			if rep.Image == nil || rep.Image.ManifestRead || len(rep.Image.Packages) > 0 || rep.Image.Name != "agent" ||
				len(rep.Image.Problems) != 1 || !strings.Contains(rep.Image.Problems[0], c.want) {
				t.Errorf("image %+v", rep.Image)
			}
		})
	}
}
