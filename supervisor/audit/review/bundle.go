package review

import (
	"archive/tar"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"

	"github.com/carrel-os/carrel/supervisor/audit"
)

// An evidence bundle is a tar file:
//
//	manifest.json                 what the bundle holds (Manifest)
//	manifest.sig                  the manifest's SHA-256, signed by the log's key (a note)
//	checkpoint                    the signed checkpoint the proofs are against
//	                              (with the witnesses' cosignatures, when it has them)
//	key.pub                       the verifier key of the log that signed it
//	records/<seq %020d>.json      a record's payload, byte for byte as in records.log
//	records/<seq %020d>.proof     its RFC 6962 inclusion proof: one base64 hash a line
//	blobs/sha256/<hex>            the blobs the records reference
//
// Every file but the blobs is small; names are fixed, so a verifier
// rejects anything else.
const (
	BundleFormat      = "carrel-audit-bundle/1"
	bundleManifest    = "manifest.json"
	bundleManifestSig = "manifest.sig"
	bundleCheckpoint  = "checkpoint"
	bundleKey         = "key.pub"
	bundleRecords     = "records/"
	bundleBlobs       = "blobs/sha256/"
)

// Manifest describes a bundle. VerifyBundle recomputes every field it can
// from the records and the checkpoint, and checks manifest.sig, the log
// key's signature of the manifest's bytes, when the bundle has one.
type Manifest struct {
	Format  string    `json:"format"`
	Created time.Time `json:"created"`
	Session string    `json:"session"`
	VM      string    `json:"vm"`
	// ImageDigest and Policy, PolicyRevision are what the session's first
	// vm.lifecycle record that names them says (or, for the policy, its
	// first policy.decision).
	ImageDigest    string `json:"image_digest,omitempty"`
	Policy         string `json:"policy,omitempty"`
	PolicyRevision string `json:"policy_revision,omitempty"`
	// Policies are every policy and revision the session's records name,
	// in order of first appearance.
	Policies []PolicyRef `json:"policies,omitempty"`
	// First and Last are the times of the first and last record.
	First time.Time `json:"first"`
	Last  time.Time `json:"last"`
	// Records is how many records the bundle holds, Seqs which.
	Records int      `json:"records"`
	Seqs    []uint64 `json:"seqs"`
	Blobs   []string `json:"blobs"`
	// TreeSize and Root are the checkpoint's.
	TreeSize uint64 `json:"tree_size"`
	Root     string `json:"root"`
	Key      string `json:"key"`
	// Unsigned counts the session's records that followed the checkpoint
	// when the bundle was made, and are not in it.
	Unsigned int `json:"unsigned,omitempty"`
}

// PolicyRef names a policy bundle's revision.
type PolicyRef struct {
	Name     string `json:"name"`
	Revision string `json:"revision"`
}

// describe fills the fields of m that the records determine.
func (m *Manifest) describe(entries []Entry) {
	m.Records = len(entries)
	m.Seqs = make([]uint64, 0, len(entries))
	blobs := map[string]bool{}
	for i := range entries {
		e := &entries[i]
		m.Seqs = append(m.Seqs, e.Seq)
		for _, b := range e.Blobs {
			blobs[b] = true
		}
		if i == 0 {
			m.First = e.Time
		}
		m.Last = e.Time
		switch e.Kind {
		case audit.KindVMLifecycle:
			var d audit.Lifecycle
			if decodeData(e, &d) {
				if m.ImageDigest == "" {
					m.ImageDigest = d.ImageDigest
				}
				if m.Policy == "" && m.PolicyRevision == "" {
					m.Policy, m.PolicyRevision = d.Policy, d.PolicyRevision
				}
				m.addPolicy(d.Policy, d.PolicyRevision)
			}
		case audit.KindPolicyDecision:
			var d audit.Decision
			if decodeData(e, &d) {
				m.addPolicy(d.Policy, d.Revision)
			}
		}
	}
	if m.Policy == "" && m.PolicyRevision == "" && len(m.Policies) > 0 {
		m.Policy, m.PolicyRevision = m.Policies[0].Name, m.Policies[0].Revision
	}
	m.Blobs = slices.Sorted(func(yield func(string) bool) {
		for b := range blobs {
			if !yield(b) {
				return
			}
		}
	})
}

func (m *Manifest) addPolicy(name, rev string) {
	if name == "" && rev == "" {
		return
	}
	p := PolicyRef{name, rev}
	if !slices.Contains(m.Policies, p) {
		m.Policies = append(m.Policies, p)
	}
}

// ExportOptions tune Export.
type ExportOptions struct {
	// Key is the verifier key the checkpoint must verify with; empty
	// means the log's key.pub.
	Key string
	// Now is the bundle's creation time; default time.Now.
	Now func() time.Time
	// Signer, the log's own key (audit.Signer), signs the manifest; nil
	// leaves it unsigned.
	Signer note.Signer
}

// manifestSigText is the text of manifest.sig's note: what it signs.
func manifestSigText(manifest []byte) string {
	sum := sha256.Sum256(manifest)
	return BundleFormat + " manifest\n" + hex.EncodeToString(sum[:]) + "\n"
}

// ErrNoCheckpoint means no signed checkpoint covers the session yet.
var ErrNoCheckpoint = errors.New("no signed checkpoint covers the session yet: carreld signs one every 5 seconds while records arrive; export again")

// Export writes the session's evidence bundle to w: its records up to
// the log's latest checkpoint, each with its inclusion proof against it,
// the blobs they reference, the checkpoint, the verifier key and a
// manifest. It checks every proof, and every blob's content, before it
// writes them: a log that does not match its checkpoint is an error, not
// a bundle.
func Export(w io.Writer, r *audit.Reader, s *Session, opts ExportOptions) (*Manifest, error) {
	if opts.Now == nil {
		opts.Now = time.Now
	}
	key := strings.TrimSpace(opts.Key)
	if key == "" {
		k, err := audit.PublicKey(r.Dir())
		if err != nil {
			return nil, err
		}
		key = k
	}
	cp, err := r.LatestCheckpoint(key)
	if err != nil {
		return nil, fmt.Errorf("export session %s: %w", s.ID, err)
	}
	if cp == nil || s.Entries[0].Seq >= cp.Size {
		return nil, fmt.Errorf("export session %s: %w", s.ID, ErrNoCheckpoint)
	}
	n := 0
	for n < len(s.Entries) && s.Entries[n].Seq < cp.Size {
		n++
	}
	entries := s.Entries[:n]
	m := &Manifest{Format: BundleFormat, Created: opts.Now().UTC(), Session: s.ID, VM: s.VM,
		TreeSize: cp.Size, Root: cp.Root.String(), Key: key, Unsigned: len(s.Entries) - n}
	m.describe(entries)

	prover, err := r.Prover(cp)
	if err != nil {
		return nil, fmt.Errorf("export session %s: %w", s.ID, err)
	}
	defer prover.Close()
	proofs := make([]tlog.RecordProof, len(entries))
	for i := range entries {
		if proofs[i], err = prover.Prove(entries[i].Seq, entries[i].Payload); err != nil {
			return nil, fmt.Errorf("export session %s: %w", s.ID, err)
		}
	}

	tw := tar.NewWriter(w)
	file := func(name string, b []byte) error {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(b)), ModTime: m.Created, Typeflag: tar.TypeReg, Format: tar.FormatPAX}); err != nil {
			return err
		}
		_, err := tw.Write(b)
		return err
	}
	mb, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return nil, err
	}
	mb = append(mb, '\n')
	if err := file(bundleManifest, mb); err != nil {
		return nil, err
	}
	if opts.Signer != nil {
		sig, err := note.Sign(&note.Note{Text: manifestSigText(mb)}, opts.Signer)
		if err != nil {
			return nil, fmt.Errorf("sign the manifest: %w", err)
		}
		if err := file(bundleManifestSig, sig); err != nil {
			return nil, err
		}
	}
	if err := file(bundleCheckpoint, cp.Note); err != nil {
		return nil, err
	}
	if err := file(bundleKey, []byte(key+"\n")); err != nil {
		return nil, err
	}
	for i := range entries {
		name := fmt.Sprintf("%s%020d", bundleRecords, entries[i].Seq)
		if err := file(name+".json", entries[i].Payload); err != nil {
			return nil, err
		}
		if err := file(name+".proof", formatProof(proofs[i])); err != nil {
			return nil, err
		}
	}
	for _, d := range m.Blobs {
		if err := copyBlob(tw, r.Dir(), d, m.Created); err != nil {
			return nil, fmt.Errorf("export session %s: %w", s.ID, err)
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return m, nil
}

func formatProof(p tlog.RecordProof) []byte {
	var b strings.Builder
	for _, h := range p {
		b.WriteString(h.String())
		b.WriteByte('\n')
	}
	return []byte(b.String())
}

// copyBlob writes a blob into the bundle, checking that its content
// hashes to its name.
func copyBlob(tw *tar.Writer, dir, digest string, mtime time.Time) error {
	path, err := audit.BlobPath(dir, digest)
	if err != nil {
		return err
	}
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("blob %s: %w (run carrel audit verify)", digest, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	name := bundleBlobs + strings.TrimPrefix(digest, "sha256:")
	if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: st.Size(), ModTime: mtime, Typeflag: tar.TypeReg, Format: tar.FormatPAX}); err != nil {
		return err
	}
	h := sha256.New()
	if _, err := io.CopyN(io.MultiWriter(tw, h), f, st.Size()); err != nil {
		return fmt.Errorf("blob %s: %w", digest, err)
	}
	if got := "sha256:" + hex.EncodeToString(h.Sum(nil)); got != digest {
		return fmt.Errorf("blob %s: its content hashes to %s: it was replaced (run carrel audit verify)", digest, got)
	}
	return nil
}
