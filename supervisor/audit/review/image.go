package review

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"slices"

	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/supervisor/audit"
)

// Image is the image a session ran on: what its first created or
// starting vm.lifecycle record says, and what the image manifest that
// record keeps as a blob lists. Every string in it is safe to print: the
// record's are cleaned, and manifest.Parse admits only printable ASCII
// words in the manifest's.
type Image struct {
	// Seq is the record the image is read from.
	Seq    uint64 `json:"seq"`
	Name   string `json:"name,omitempty"`
	Digest string `json:"digest,omitempty"`
	// RootHash is the dm-verity root hash (hex) of the image's read-only
	// root file system; empty for an image without one.
	RootHash string `json:"root_hash,omitempty"`
	// ManifestRead says the manifest blob was there, hashed to Digest and
	// parsed; KernelVersion, Arch and Packages come from it.
	ManifestRead  bool               `json:"manifest_read"`
	KernelVersion string             `json:"kernel_version,omitempty"`
	Arch          string             `json:"arch,omitempty"`
	Packages      []manifest.Package `json:"packages,omitempty"`
	// Problems say why the manifest was not read, or where it and the
	// record disagree.
	Problems []string `json:"problems,omitempty"`
}

// blobFunc reads a blob that may be an image manifest. It fails with
// fs.ErrNotExist when the blob is not there, and errManifestTooLarge when
// it is larger than manifest.MaxSize.
type blobFunc func(digest string) ([]byte, error)

var errManifestTooLarge = fmt.Errorf("larger than a manifest can be (%d bytes)", manifest.MaxSize)

// LoadImage reads the image the session ran on from its records and the
// log's blobs in r's directory. It is nil when no vm.lifecycle record of
// the session names an image. A manifest that is missing, replaced or
// unreadable is not an error: Problems says so.
func LoadImage(r *audit.Reader, s *Session) *Image {
	return readImage(s.Entries, dirBlobs(r.Dir()))
}

// imageRecord is the session's first created or starting vm.lifecycle
// record that names an image (the one that keeps its manifest), else its
// first vm.lifecycle record that names one.
func imageRecord(entries []Entry) (*Entry, audit.Lifecycle, bool) {
	var first *Entry
	var firstData audit.Lifecycle
	for i := range entries {
		e := &entries[i]
		if e.Kind != audit.KindVMLifecycle {
			continue
		}
		var d audit.Lifecycle
		if !decodeData(e, &d) || d.ImageDigest == "" {
			continue
		}
		if d.Event == "created" || d.Event == "starting" {
			return e, d, true
		}
		if first == nil {
			first, firstData = e, d
		}
	}
	return first, firstData, first != nil
}

// readImage reads the session's image, taking its manifest from blob.
func readImage(entries []Entry, blob blobFunc) *Image {
	e, d, ok := imageRecord(entries)
	if !ok {
		return nil
	}
	img := &Image{Seq: e.Seq, Name: clean(d.ImageName, maxField), Digest: clean(d.ImageDigest, maxField), RootHash: clean(d.RootHash, maxField)}
	problem := func(format string, args ...any) { img.Problems = append(img.Problems, fmt.Sprintf(format, args...)) }
	if !slices.Contains(e.Blobs, d.ImageDigest) {
		problem("record %d keeps no copy of the image's manifest, so its packages are not known here", e.Seq)
		return img
	}
	what := fmt.Sprintf("the image's manifest (blob %s, record %d)", img.Digest, e.Seq)
	b, err := blob(d.ImageDigest)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		problem("%s is missing, so its packages are not known here", what)
		return img
	case err != nil:
		problem("%s cannot be read: %s", what, clean(err.Error(), maxField))
		return img
	}
	if got := manifest.DigestBytes(b); got != d.ImageDigest {
		problem("%s was replaced: its content hashes to %s, not to the image's digest; its packages are not shown", what, got)
		return img
	}
	m, err := manifest.Parse(b)
	if err != nil {
		problem("%s is not a manifest this carrel can read: %s", what, clean(err.Error(), maxField))
		return img
	}
	img.ManifestRead, img.KernelVersion, img.Arch, img.Packages = true, m.KernelVersion, m.Arch, m.Packages
	rootHash := ""
	if m.Verity != nil {
		rootHash = m.Verity.RootHash
	}
	for _, c := range []struct {
		what      string
		field     *string
		recorded  string
		inContent string
	}{{"image name", &img.Name, d.ImageName, m.Name}, {"root hash", &img.RootHash, d.RootHash, rootHash}} {
		switch {
		case c.recorded == "":
			*c.field = c.inContent
		case c.recorded != c.inContent:
			problem("record %d says %s %q, the image's manifest %q", e.Seq, c.what, *c.field, c.inContent)
		}
	}
	return img
}

// dirBlobs reads blobs from the log in dir.
func dirBlobs(dir string) blobFunc {
	return func(digest string) ([]byte, error) {
		path, err := audit.BlobPath(dir, digest)
		if err != nil {
			return nil, err
		}
		f, err := os.Open(path)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		if st, err := f.Stat(); err != nil {
			return nil, err
		} else if !st.Mode().IsRegular() {
			return nil, errors.New("not a regular file")
		}
		b, err := io.ReadAll(io.LimitReader(f, manifest.MaxSize+1))
		if err == nil && len(b) > manifest.MaxSize {
			err = errManifestTooLarge
		}
		return b, err
	}
}
