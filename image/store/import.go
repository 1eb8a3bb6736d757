package store

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/carrel-os/carrel/image/imagedir"
	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/supervisor/atomicfile"
)

// Imported is what Import did.
type Imported struct {
	Digest   string
	Manifest *manifest.Manifest
	// Already is set when the store held the image, and the tag pointed at
	// it, before the call: nothing was written.
	Already bool
}

// ImportNamed imports dir as Import does, tagged with its manifest's name.
func (s *Store) ImportNamed(dir string) (Imported, error) {
	d, err := imagedir.Read(dir)
	if err != nil {
		return Imported{}, fmt.Errorf("import %s: %w", dir, err)
	}
	return s.Import(dir, d.Manifest.Name)
}

// Import copies the image directory dir (see image/imagedir) into the
// store and points tag at it. Every part is copied to the store's temp
// space first and hashed as it is copied, and the dm-verity tree is
// recomputed from those copies, not from dir, which may change meanwhile.
// Only when everything matches the manifest are the blobs, the manifest
// and the tag committed, in that order; on any failure (a bad directory, a
// mismatch, a full disk) the temp copies are removed and the store is as
// it was. Importing an image that is already stored and tagged so is a
// no-op that reports Already.
func (s *Store) Import(dir, tag string) (Imported, error) {
	if tag != "" && !ValidTagName(tag) {
		return Imported{}, fmt.Errorf("import %s: tag %q: %w", dir, tag, ErrInvalidRef)
	}
	d, err := imagedir.Read(dir)
	if err != nil {
		return Imported{}, fmt.Errorf("import %s: %w", dir, err)
	}
	out := Imported{Digest: d.Digest, Manifest: d.Manifest}
	if s.has(d.Digest) && (tag == "" || s.tagIs(tag, d.Digest)) {
		out.Already = true
		return out, nil
	}
	// Every temp file, in commit order: the parts' blobs, then the
	// manifest, then the tag. Those not yet committed are removed on return.
	var commits []staged
	defer func() {
		for _, c := range commits {
			if c.tmp != "" {
				os.Remove(c.tmp)
			}
		}
	}()
	byPart := map[string]string{}
	for _, f := range d.Files {
		tmp, err := s.stage(f)
		if err != nil {
			return Imported{}, fmt.Errorf("import %s: %s: %w", dir, f.Name, err)
		}
		commits = append(commits, staged{tmp, s.blobPath(f.Part.Digest)})
		byPart[f.Name] = tmp
	}
	if err := imagedir.VerifySystem(d.Manifest, byPart[manifest.PartSystem], byPart[manifest.PartSystemVerity]); err != nil {
		return Imported{}, fmt.Errorf("import %s: %w", dir, err)
	}
	// The manifest and the tag are written before the first rename too, so
	// that a full disk fails the import while the store is as it was. An
	// identical stored manifest is kept, and so its mtime, which List
	// reports as Created.
	canon, err := d.Manifest.Marshal()
	if err != nil {
		return Imported{}, fmt.Errorf("import %s: %w", dir, err)
	}
	if old, err := readLimited(s.manifestPath(d.Digest), manifest.MaxSize); err != nil || string(old) != string(canon) {
		tmp, err := s.stageBytes(canon, 0o444)
		if err != nil {
			return Imported{}, fmt.Errorf("import %s: manifest: %w", dir, err)
		}
		commits = append(commits, staged{tmp, s.manifestPath(d.Digest)})
	}
	if tag != "" {
		tmp, err := s.stageBytes([]byte(d.Digest+"\n"), 0o644)
		if err != nil {
			return Imported{}, fmt.Errorf("import %s: tag %q: %w", dir, tag, err)
		}
		commits = append(commits, staged{tmp, filepath.Join(s.dir, tagDir, tag)})
	}
	for i := range commits {
		if err := commitStaged(commits[i]); err != nil {
			return Imported{}, fmt.Errorf("import %s: %w", dir, err)
		}
		commits[i].tmp = ""
	}
	return out, nil
}

// staged is a temp file and where it goes when the import commits.
type staged struct{ tmp, dst string }

// has reports whether digest's manifest and all its blobs are stored.
func (s *Store) has(digest string) bool {
	_, err := s.resolveDigest(digest)
	return err == nil
}

func (s *Store) tagIs(tag, digest string) bool {
	d, err := s.readTag(tag)
	return err == nil && d == digest
}

// stage copies f into a synced, read-only temp file in the store, checking
// its size and digest, and returns the temp file's path.
func (s *Store) stage(f imagedir.File) (string, error) {
	in, err := imagedir.OpenPart(f.Path)
	if err != nil {
		return "", err
	}
	defer in.Close()
	blobs := s.blobs // whose temp files are named as an import's
	blobs.TempPattern = ".import-*"
	st, err := blobs.Stage(io.LimitReader(in, f.Part.Size+1))
	if err != nil {
		return "", err
	}
	switch {
	case st.Size != f.Part.Size:
		err = fmt.Errorf("%s is %d bytes now, the manifest says %d", f.Path, st.Size, f.Part.Size)
	case st.Digest != f.Part.Digest:
		err = fmt.Errorf("%s hashes to %s, the manifest says %s: %w", f.Path, st.Digest, f.Part.Digest, imagedir.ErrInvalid)
	default:
		return st.Temp, nil
	}
	return "", errors.Join(err, st.Discard())
}

// stageBytes writes data to a synced temp file of mode perm in the store
// and returns its path.
func (s *Store) stageBytes(data []byte, perm os.FileMode) (string, error) {
	f, err := s.createTemp(".import-*")
	if err != nil {
		return "", err
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Chmod(perm)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "", errors.Join(err, os.Remove(f.Name()))
	}
	return f.Name(), nil
}

// commitStaged renames a staged file into place and syncs its directory.
func commitStaged(c staged) error {
	if err := os.Rename(c.tmp, c.dst); err != nil {
		return fmt.Errorf("rename into place: %w", err)
	}
	return atomicfile.SyncDir(filepath.Dir(c.dst))
}
