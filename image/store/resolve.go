package store

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/supervisor/cas"
)

// Resolved is an image whose manifest and parts were found in the store.
type Resolved struct {
	Digest     string
	Manifest   *manifest.Manifest
	KernelPath string
	InitrdPath string
	// WorkspacePath is the workspace template's blob; "" when the image
	// has none.
	WorkspacePath string
	// SystemPath and SystemVerityPath are the verified root file system
	// and its hash device; "" when the image has none.
	SystemPath       string
	SystemVerityPath string
}

// Resolve looks up ref, a tag name or a manifest digest ("sha256:<hex>").
// It checks that the manifest's bytes hash to its digest and that both parts
// exist with the stated sizes, but it does not hash the parts (see Verify).
// An unknown tag or digest gives an error wrapping ErrNotFound; a malformed
// ref, ErrInvalidRef; a damaged entry, ErrCorrupt.
func (s *Store) Resolve(ref string) (*Resolved, error) {
	digest, err := s.refDigest(ref)
	if err != nil {
		return nil, fmt.Errorf("resolve %q: %w", ref, err)
	}
	r, err := s.resolveDigest(digest)
	if err != nil {
		return nil, fmt.Errorf("resolve %q: %w", ref, err)
	}
	return r, nil
}

func (s *Store) refDigest(ref string) (string, error) {
	if strings.HasPrefix(ref, manifest.DigestPrefix) {
		if err := manifest.ValidateDigest(ref); err != nil {
			return "", fmt.Errorf("%w: %w", ErrInvalidRef, err)
		}
		return ref, nil
	}
	if !ValidTagName(ref) {
		return "", fmt.Errorf("%w: want a tag name or %s<hex>", ErrInvalidRef, manifest.DigestPrefix)
	}
	return s.readTag(ref)
}

func (s *Store) resolveDigest(digest string) (*Resolved, error) {
	b, err := readLimited(s.manifestPath(digest), manifest.MaxSize)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("manifest %s: %w", digest, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("manifest %s: %w: %w", digest, ErrCorrupt, err)
	}
	if got := manifest.DigestBytes(b); got != digest {
		return nil, fmt.Errorf("manifest %s hashes to %s: %w", digest, got, ErrCorrupt)
	}
	m, err := manifest.Parse(b)
	if err != nil {
		return nil, fmt.Errorf("manifest %s: %w: %w", digest, ErrCorrupt, err)
	}
	for _, p := range m.Parts() {
		if err := s.checkBlob(p.Part); err != nil {
			// A manifest whose blob is gone is damage, not an unknown image.
			if errors.Is(err, ErrNotFound) {
				err = fmt.Errorf("blob %s is missing: %w", p.Part.Digest, ErrCorrupt)
			}
			return nil, fmt.Errorf("manifest %s: %s: %w", digest, p.Name, err)
		}
	}
	r := &Resolved{
		Digest:     digest,
		Manifest:   m,
		KernelPath: s.blobPath(m.Kernel.Digest),
		InitrdPath: s.blobPath(m.Initrd.Digest),
	}
	if m.Workspace != nil {
		r.WorkspacePath = s.blobPath(m.Workspace.Digest)
	}
	if m.System != nil {
		r.SystemPath = s.blobPath(m.System.Digest)
		r.SystemVerityPath = s.blobPath(m.SystemVerity.Digest)
	}
	return r, nil
}

// ManifestBytes returns the stored manifest of digest as stored: its
// canonical encoding, whose sha256 is digest.
func (s *Store) ManifestBytes(digest string) ([]byte, error) {
	if err := manifest.ValidateDigest(digest); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidRef, err)
	}
	b, err := readLimited(s.manifestPath(digest), manifest.MaxSize)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("manifest %s: %w", digest, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("manifest %s: %w", digest, err)
	}
	if got := manifest.DigestBytes(b); got != digest {
		return nil, fmt.Errorf("manifest %s hashes to %s: %w", digest, got, ErrCorrupt)
	}
	return b, nil
}

// Verify resolves ref and then hashes every part in full; a part whose
// content does not match its digest gives an error wrapping ErrCorrupt.
func (s *Store) Verify(ref string) (*Resolved, error) {
	r, err := s.Resolve(ref)
	if err != nil {
		return nil, err
	}
	for _, np := range r.Manifest.Parts() {
		p := np.Part
		var bad *cas.MismatchError
		switch err := s.blobs.Check(p.Digest); {
		case errors.As(err, &bad):
			return nil, fmt.Errorf("verify %q: blob %s hashes to %s: %w", ref, p.Digest, bad.Got, ErrCorrupt)
		case err != nil:
			return nil, fmt.Errorf("verify %q: %w", ref, err)
		}
	}
	return r, nil
}

// Entry is one stored image as List reports it.
type Entry struct {
	Digest string   `json:"digest"`
	Tags   []string `json:"tags"`
	// Manifest is nil when Error is set.
	Manifest *manifest.Manifest `json:"manifest,omitempty"`
	// Created is when the manifest was first committed to this store.
	Created time.Time `json:"created"`
	// Size is the size of all its parts (kernel, initrd, workspace
	// template) in bytes.
	Size int64 `json:"size"`
	// Error says why the entry cannot be resolved; empty when it can.
	Error string `json:"error,omitempty"`
}

// List returns every manifest in the store, oldest first, with the tags
// that point at it. A damaged entry is listed with Error set rather than
// failing the whole listing; tags that point at no manifest are left out.
func (s *Store) List() ([]Entry, error) {
	dir := filepath.Join(s.dir, manifestDir)
	des, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("list images: %w", err)
	}
	tags, err := s.tagsByDigest()
	if err != nil {
		return nil, fmt.Errorf("list images: %w", err)
	}
	entries := []Entry{}
	for _, de := range des {
		h, ok := strings.CutSuffix(de.Name(), ".json")
		digest := manifest.DigestPrefix + h
		if !ok || manifest.ValidateDigest(digest) != nil {
			continue
		}
		e := Entry{Digest: digest, Tags: tags[digest]}
		if e.Tags == nil {
			e.Tags = []string{}
		}
		if info, err := de.Info(); err == nil {
			e.Created = info.ModTime().UTC()
		}
		if r, err := s.resolveDigest(digest); err != nil {
			e.Error = err.Error()
		} else {
			e.Manifest = r.Manifest
			for _, p := range r.Manifest.Parts() {
				e.Size += p.Part.Size
			}
		}
		entries = append(entries, e)
	}
	sort.Slice(entries, func(i, j int) bool {
		if !entries[i].Created.Equal(entries[j].Created) {
			return entries[i].Created.Before(entries[j].Created)
		}
		return entries[i].Digest < entries[j].Digest
	})
	return entries, nil
}

// tagsByDigest maps each digest to its sorted tag names; unreadable tags are
// skipped since they resolve to nothing.
func (s *Store) tagsByDigest() (map[string][]string, error) {
	des, err := os.ReadDir(filepath.Join(s.dir, tagDir))
	if err != nil {
		return nil, err
	}
	out := map[string][]string{}
	for _, de := range des { // ReadDir sorts by name, so each slice is sorted
		if !de.Type().IsRegular() || !ValidTagName(de.Name()) {
			continue
		}
		if d, err := s.readTag(de.Name()); err == nil {
			out[d] = append(out[d], de.Name())
		}
	}
	return out, nil
}
