package devimage

import (
	"fmt"

	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/image/store"
)

// StoreResult copies a built image into st and, if tag is not empty, points
// tag at it. It fails, storing no manifest, if a part (kernel, initrd,
// workspace template) no longer matches the digest Build recorded. It
// returns the manifest digest.
func StoreResult(st *store.Store, res *Result, tag string) (string, error) {
	if tag != "" && !store.ValidTagName(tag) {
		return "", fmt.Errorf("store dev image: tag %q: %w", tag, store.ErrInvalidRef)
	}
	parts := []struct {
		what, path string
		want       manifest.Part
	}{
		{"kernel", res.KernelPath, res.Manifest.Kernel},
		{"initrd", res.InitrdPath, res.Manifest.Initrd},
	}
	if res.Manifest.Workspace != nil {
		parts = append(parts, struct {
			what, path string
			want       manifest.Part
		}{"workspace template", res.WorkspacePath, *res.Manifest.Workspace})
	}
	for _, p := range parts {
		got, err := st.PutBlob(p.path)
		if err != nil {
			return "", fmt.Errorf("store dev image: %s: %w", p.what, err)
		}
		if got != p.want {
			return "", fmt.Errorf("store dev image: %s %s changed since it was built (now %s, %d bytes)", p.what, p.path, got.Digest, got.Size)
		}
	}
	digest, err := st.PutManifest(res.Manifest)
	if err != nil {
		return "", fmt.Errorf("store dev image: %w", err)
	}
	if tag != "" {
		if err := st.Tag(tag, digest); err != nil {
			return "", fmt.Errorf("store dev image: %w", err)
		}
	}
	return digest, nil
}
