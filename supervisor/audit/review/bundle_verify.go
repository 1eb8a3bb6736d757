package review

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"

	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/supervisor/audit"
)

// Problems VerifyBundle finds, besides audit's ProblemRecord,
// ProblemIntent, ProblemBlobMissing, ProblemBlobMismatch and
// ProblemCheckpointSignature.
const (
	// ProblemBundle: a file missing, repeated, unexpected or too large.
	ProblemBundle audit.ProblemKind = "bundle"
	// ProblemProof: a record its inclusion proof does not put in the
	// checkpoint's tree: changed, or not the log's record at that seq.
	ProblemProof audit.ProblemKind = "proof"
	// ProblemManifest: the manifest says what the records do not.
	ProblemManifest audit.ProblemKind = "manifest"
)

// Caps on what VerifyBundle reads into memory; blobs are only hashed.
const (
	maxManifestSize    = 64 << 20
	maxCheckpointSize  = 64 << 10
	maxKeySize         = 4 << 10
	maxProofSize       = 64 << 10
	maxBundleRecordsSz = 1 << 30
)

// BundleVerifyOptions tune VerifyBundle.
type BundleVerifyOptions struct {
	// Key is the verifier key the checkpoint must verify with. Empty
	// means the bundle's own key.pub, which proves only that the bundle
	// is consistent: whoever made it could have signed it with a key of
	// their own.
	Key string
	// Witnesses are the keys of witnesses (witness.NewVerifier) whose
	// cosignatures the checkpoint must carry: every one of theirs on it
	// must verify, and at least Quorum of them (default 1) must be there.
	Witnesses []note.Verifier
	Quorum    int
	// MaxProblems caps the problems listed (default 1000).
	MaxProblems int
}

// BundleReport is what VerifyBundle found.
type BundleReport struct {
	Manifest *Manifest `json:"manifest,omitempty"`
	Records  int       `json:"records"`
	Blobs    int       `json:"blobs"`
	// TreeSize is the size of the checkpoint the proofs were checked
	// against; CheckpointVerified says whether its signature verified.
	TreeSize           uint64 `json:"tree_size"`
	CheckpointVerified bool   `json:"checkpoint_verified"`
	// KeyFromBundle: the checkpoint was checked with the bundle's own key.
	KeyFromBundle bool `json:"key_from_bundle"`
	// Cosigned: with witnesses, those whose cosignature of the
	// checkpoint verified.
	Cosigned []string `json:"cosigned,omitempty"`
	// ManifestSigned: manifest.sig is the key's valid signature of the
	// manifest. A bundle without one says so in Notes.
	ManifestSigned bool     `json:"manifest_signed"`
	Notes          []string `json:"notes,omitempty"`
	// Image is the image the session ran on, with the packages of the
	// manifest its records keep, when the bundle holds them.
	Image    *Image          `json:"image,omitempty"`
	Problems []audit.Problem `json:"problems"`
	Omitted  int             `json:"omitted,omitempty"`
}

// OK reports whether VerifyBundle found nothing wrong.
func (r *BundleReport) OK() bool { return len(r.Problems) == 0 && r.Omitted == 0 }

type bundleBlob struct {
	got  string // the digest of its content
	size int64
}

type bundleFiles struct {
	manifest, manifestSig, checkpoint, key []byte
	records, proofs                        map[uint64][]byte
	blobs                                  map[string]bundleBlob
	seen                                   map[string]bool
	// imageManifests are the blobs that vm.lifecycle records read before
	// them keep as their image's manifest, up to maxKeptManifests bytes.
	imageManifests map[string][]byte
	wantManifests  map[string]bool
	keptManifests  int64
}

// maxKeptManifests caps the image manifests VerifyBundle keeps to show
// the session's image: a session has one image, but a hostile bundle
// may name many.
const maxKeptManifests = 4 * manifest.MaxSize

// wantManifest notes the image manifest a vm.lifecycle record keeps.
func (f *bundleFiles) wantManifest(payload []byte) {
	if !bytes.Contains(payload, []byte(`"`+audit.KindVMLifecycle+`"`)) {
		return
	}
	rec, err := audit.Decode(payload)
	if err != nil || rec.Kind != audit.KindVMLifecycle {
		return
	}
	e := Entry{Record: rec}
	var d audit.Lifecycle
	if decodeData(&e, &d) && slices.Contains(rec.Blobs, d.ImageDigest) {
		f.wantManifests[d.ImageDigest] = true
	}
}

// manifestBlob reads an image manifest kept from the bundle.
func (f *bundleFiles) manifestBlob(digest string) ([]byte, error) {
	if b, ok := f.imageManifests[digest]; ok {
		return b, nil
	}
	b, ok := f.blobs[digest]
	switch {
	case !ok:
		return nil, fs.ErrNotExist
	case b.size > manifest.MaxSize:
		return nil, errManifestTooLarge
	}
	return nil, fmt.Errorf("it was not kept from the bundle: it comes before the record that names it, or after %d MiB of other manifests", maxKeptManifests>>20)
}

// VerifyBundle checks an evidence bundle offline: the checkpoint's
// signature, each record's inclusion proof against the checkpoint's root,
// each blob's content against its name and that every blob a record
// references is there, that outcomes come with their intents, and that
// the manifest says what the records say. It also reads the session's
// image from the manifest blob its records keep (BundleReport.Image). It
// returns an error only when it cannot read the bundle; what is wrong
// with it is in the report.
func VerifyBundle(rd io.Reader, opts BundleVerifyOptions) (*BundleReport, error) {
	if opts.MaxProblems <= 0 {
		opts.MaxProblems = 1000
	}
	rep := &BundleReport{Problems: []audit.Problem{}}
	v := &bundleVerifier{rep: rep, max: opts.MaxProblems}
	files, err := v.read(rd)
	if err != nil {
		return nil, err
	}
	rep.Records, rep.Blobs = len(files.records), len(files.blobs)

	// The key and the checkpoint.
	key := strings.TrimSpace(opts.Key)
	keyPub := strings.TrimSpace(string(files.key))
	if files.key == nil {
		v.add(audit.Problem{Kind: ProblemBundle, Detail: "no " + bundleKey + " (the verifier key)"})
	}
	if key == "" {
		key, rep.KeyFromBundle = keyPub, true
		rep.Notes = append(rep.Notes, "the checkpoint was checked with the bundle's own key.pub, which proves only that the bundle is consistent: "+
			"whoever made it could have signed it with a key of their own; pass --key with the log's key (carrel audit key on its host)")
	} else if files.key != nil && keyPub != key {
		rep.Notes = append(rep.Notes, "the bundle's key.pub is not the key given; the checkpoint was checked with the key given")
	}
	var cpSize uint64
	var cpRoot tlog.Hash
	haveRoot := false
	switch {
	case files.checkpoint == nil:
		v.add(audit.Problem{Kind: ProblemBundle, Detail: "no " + bundleCheckpoint + ": the records cannot be checked"})
	case key == "":
		v.add(audit.Problem{Kind: audit.ProblemCheckpointSignature, Detail: "no key to check the checkpoint with"})
	default:
		cp, err := audit.ParseCheckpoint(files.checkpoint, key)
		if err == nil {
			cpSize, cpRoot, haveRoot, rep.CheckpointVerified = cp.Size, cp.Root, true, true
			break
		}
		v.add(audit.Problem{Kind: audit.ProblemCheckpointSignature, Detail: fmt.Sprintf("the checkpoint does not verify: %v", err)})
		if size, root, ok := unverifiedCheckpoint(files.checkpoint); ok {
			cpSize, cpRoot, haveRoot = size, root, true
			rep.Notes = append(rep.Notes, "the inclusion proofs were checked against the checkpoint's unverified text")
		}
	}
	rep.TreeSize = cpSize
	if len(opts.Witnesses) > 0 && files.checkpoint != nil {
		v.witnessed(files.checkpoint, key, rep.CheckpointVerified, cpSize, cpRoot, opts.Witnesses, max(opts.Quorum, 1))
	}

	// The records, their proofs and what they reference.
	seqs := slices.Sorted(func(yield func(uint64) bool) {
		for s := range files.records {
			if !yield(s) {
				return
			}
		}
	})
	entries := make([]Entry, 0, len(seqs))
	present := map[uint64]string{} // seq -> kind
	for _, seq := range seqs {
		payload := files.records[seq]
		at := func(kind audit.ProblemKind, format string, args ...any) {
			v.add(audit.Problem{Kind: kind, Seq: ptr(seq), Detail: fmt.Sprintf(format, args...)})
		}
		proofText, ok := files.proofs[seq]
		if !ok {
			at(ProblemBundle, "no inclusion proof (%s%020d.proof)", bundleRecords, seq)
		} else if haveRoot {
			switch proof, err := parseProof(proofText); {
			case err != nil:
				at(ProblemProof, "unreadable inclusion proof: %v", err)
			case seq >= cpSize:
				at(ProblemProof, "not in the checkpoint's tree of %d records", cpSize)
			default:
				if err := audit.CheckProof(proof, cpSize, cpRoot, seq, payload); err != nil {
					at(ProblemProof, "not in the checkpoint's tree: the record was changed, or is not the log's record %d (%v)", seq, err)
				}
			}
		}
		rec, err := audit.Decode(payload)
		if err != nil {
			at(audit.ProblemRecord, "not a record: %v", err)
			continue
		}
		if rec.Seq != seq {
			at(audit.ProblemRecord, "the file is named for record %d, the record says %d", seq, rec.Seq)
		}
		present[seq] = rec.Kind
		entries = append(entries, Entry{Record: rec, Payload: payload})
	}
	for seq := range files.proofs {
		if _, ok := files.records[seq]; !ok {
			v.add(audit.Problem{Kind: ProblemBundle, Seq: ptr(seq), Detail: "an inclusion proof without its record: a record was removed"})
		}
	}
	refs := map[string]uint64{}
	for i := range entries {
		e := &entries[i]
		if e.Intent != nil {
			if k, ok := present[*e.Intent]; !ok {
				v.add(audit.Problem{Kind: audit.ProblemIntent, Seq: ptr(e.Seq), Detail: fmt.Sprintf("outcome of intent %d, which is not in the bundle: a record was left out", *e.Intent)})
			} else if k != audit.KindIntent {
				v.add(audit.Problem{Kind: audit.ProblemIntent, Seq: ptr(e.Seq), Detail: fmt.Sprintf("outcome of record %d, which is a %s, not an intent", *e.Intent, k)})
			}
		}
		if e.Kind == audit.KindExecOutput {
			var d audit.ExecOutput
			if decodeData(e, &d) {
				if _, ok := present[d.Exec]; !ok {
					v.add(audit.Problem{Kind: audit.ProblemIntent, Seq: ptr(e.Seq), Detail: fmt.Sprintf("output of exec %d, whose intent is not in the bundle: a record was left out", d.Exec)})
				}
			}
		}
		for _, d := range e.Blobs {
			if _, ok := refs[d]; !ok {
				refs[d] = e.Seq
			}
		}
	}
	for _, d := range slices.Sorted(mapKeys(refs)) {
		b, ok := files.blobs[d]
		switch {
		case !ok:
			v.add(audit.Problem{Kind: audit.ProblemBlobMissing, Seq: ptr(refs[d]), Blob: d, Detail: "referenced by this record, but not in the bundle"})
		case b.got != d:
			v.add(audit.Problem{Kind: audit.ProblemBlobMismatch, Seq: ptr(refs[d]), Blob: d, Detail: fmt.Sprintf("its content hashes to %s: it was replaced", b.got)})
		}
	}
	for _, d := range slices.Sorted(mapKeys(files.blobs)) {
		if _, ok := refs[d]; !ok {
			v.add(audit.Problem{Kind: ProblemBundle, Blob: d, Detail: "a blob no record in the bundle references"})
		}
	}

	rep.Image = readImage(entries, files.manifestBlob)

	if files.manifest == nil {
		v.add(audit.Problem{Kind: ProblemBundle, Detail: "no " + bundleManifest})
		return rep, nil
	}
	var m Manifest
	if err := json.Unmarshal(files.manifest, &m); err != nil {
		v.add(audit.Problem{Kind: ProblemManifest, Detail: fmt.Sprintf("unreadable: %v", err)})
		return rep, nil
	}
	rep.Manifest = &m
	v.manifest(&m, entries, files, cpSize, cpRoot, haveRoot, keyPub)
	switch {
	case files.manifestSig == nil:
		rep.Notes = append(rep.Notes, "the manifest is not signed (the bundle was made without the log's key); its fields were checked against the records")
	case key == "":
	default:
		nv, err := note.NewVerifier(key)
		var n *note.Note
		if err == nil {
			n, err = note.Open(files.manifestSig, note.VerifierList(nv))
		}
		switch {
		case err != nil:
			v.add(audit.Problem{Kind: ProblemManifest, Detail: fmt.Sprintf("%s does not verify with the key: %v", bundleManifestSig, err)})
		case n.Text != manifestSigText(files.manifest):
			v.add(audit.Problem{Kind: ProblemManifest, Detail: bundleManifestSig + " signs another manifest: " + bundleManifest + " was changed"})
		default:
			rep.ManifestSigned = true
		}
	}
	return rep, nil
}

// witnessed holds the checkpoint msg, of size records and root, to
// quorum valid cosignatures of witnesses (audit.CheckCosignatures, as
// carrel audit verify --witness holds a log's): with fewer, what the
// bundle shows is vouched for by the host's key alone.
func (v *bundleVerifier) witnessed(msg []byte, key string, verified bool, size uint64, root tlog.Hash, witnesses []note.Verifier, quorum int) {
	name := fmt.Sprintf("the checkpoint at %d records (root %s)", size, root)
	unwitnessed := func(format string, args ...any) {
		v.add(audit.Problem{Kind: audit.ProblemUnwitnessed, Checkpoint: ptr(size), Detail: fmt.Sprintf(format, args...)})
	}
	host, err := note.NewVerifier(key)
	if !verified || err != nil {
		unwitnessed("the checkpoint does not verify with the log's key, so its cosignatures were not checked")
		return
	}
	c, err := audit.CheckCosignatures(msg, host, witnesses)
	if err != nil {
		v.add(audit.Problem{Kind: audit.ProblemCosignature, Checkpoint: ptr(size), Detail: fmt.Sprintf("%s: %v", name, err)})
		return
	}
	v.rep.Cosigned = c.Valid
	for _, w := range c.Invalid {
		v.add(audit.Problem{Kind: audit.ProblemCosignature, Checkpoint: ptr(size), Detail: fmt.Sprintf(
			"%s: the cosignature of witness %s does not match: the witness cosigned another checkpoint, not this one (rewritten and signed again?)", name, w)})
	}
	if len(c.Valid) < quorum {
		var missing []string // in the order given
		for _, w := range witnesses {
			if !slices.Contains(c.Valid, w.Name()) {
				missing = append(missing, w.Name())
			}
		}
		unwitnessed("%s has %d valid cosignatures of the %d needed; missing: witness %s: what the bundle shows is vouched for by the host's key alone",
			name, len(c.Valid), quorum, strings.Join(missing, ", witness "))
	}
}

type bundleVerifier struct {
	rep *BundleReport
	max int
}

func (v *bundleVerifier) add(p audit.Problem) {
	if len(v.rep.Problems) < v.max {
		v.rep.Problems = append(v.rep.Problems, p)
	} else {
		v.rep.Omitted++
	}
}

func ptr[T any](x T) *T { return &x }

func mapKeys[K comparable, V any](m map[K]V) func(func(K) bool) {
	return func(yield func(K) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

// read takes the bundle's files: small ones into memory, blobs hashed as
// they stream by.
func (v *bundleVerifier) read(rd io.Reader) (*bundleFiles, error) {
	f := &bundleFiles{records: map[uint64][]byte{}, proofs: map[uint64][]byte{}, blobs: map[string]bundleBlob{}, seen: map[string]bool{},
		imageManifests: map[string][]byte{}, wantManifests: map[string]bool{}}
	tr := tar.NewReader(rd)
	var recordBytes int64
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return f, nil
		}
		if err != nil {
			return nil, fmt.Errorf("read bundle: %w (not a tar file, or cut short)", err)
		}
		name := strings.TrimPrefix(hdr.Name, "./")
		if hdr.Typeflag == tar.TypeDir {
			continue // a bundle unpacked and packed again has directories
		}
		clean := path.Clean(name)
		problem := func(detail string) {
			v.add(audit.Problem{Kind: ProblemBundle, Detail: fmt.Sprintf("%q: %s", name, detail)})
		}
		switch {
		case hdr.Typeflag != tar.TypeReg:
			problem("not a regular file")
			continue
		case clean != name || strings.HasPrefix(name, "/") || strings.Contains(name, ".."):
			problem("not a name a bundle holds")
			continue
		case f.seen[name]:
			problem("appears twice")
			continue
		}
		f.seen[name] = true
		small := func(max int64) ([]byte, bool) {
			if hdr.Size > max {
				problem(fmt.Sprintf("%d bytes: larger than such a file can be (%d)", hdr.Size, max))
				return nil, false
			}
			b, err := io.ReadAll(io.LimitReader(tr, max))
			if err != nil {
				problem(err.Error())
				return nil, false
			}
			return b, true
		}
		switch {
		case name == bundleManifest:
			f.manifest, _ = small(maxManifestSize)
		case name == bundleManifestSig:
			f.manifestSig, _ = small(maxCheckpointSize)
		case name == bundleCheckpoint:
			f.checkpoint, _ = small(maxCheckpointSize)
		case name == bundleKey:
			f.key, _ = small(maxKeySize)
		case strings.HasPrefix(name, bundleRecords):
			seq, ext, ok := recordName(strings.TrimPrefix(name, bundleRecords))
			if !ok {
				problem("not a name a bundle holds")
				continue
			}
			if ext == ".proof" {
				if b, ok := small(maxProofSize); ok {
					f.proofs[seq] = b
				}
				continue
			}
			if recordBytes += hdr.Size; recordBytes > maxBundleRecordsSz {
				return nil, fmt.Errorf("read bundle: more than %d bytes of records", int64(maxBundleRecordsSz))
			}
			if b, ok := small(audit.MaxRecordSize); ok {
				f.records[seq] = b
				f.wantManifest(b)
			}
		case strings.HasPrefix(name, bundleBlobs) && validHex(strings.TrimPrefix(name, bundleBlobs)):
			digest := "sha256:" + strings.TrimPrefix(name, bundleBlobs)
			h := sha256.New()
			var w io.Writer = h
			var kept *bytes.Buffer
			if f.wantManifests[digest] && hdr.Size <= manifest.MaxSize && f.keptManifests+hdr.Size <= maxKeptManifests {
				kept = bytes.NewBuffer(make([]byte, 0, hdr.Size))
				w = io.MultiWriter(h, kept)
			}
			n, err := io.Copy(w, tr)
			if err != nil {
				return nil, fmt.Errorf("read bundle: %s: %w", name, err)
			}
			f.blobs[digest] = bundleBlob{got: "sha256:" + hex.EncodeToString(h.Sum(nil)), size: n}
			if kept != nil {
				f.imageManifests[digest] = kept.Bytes()
				f.keptManifests += int64(kept.Len())
			}
		default:
			problem("not a name a bundle holds")
		}
	}
}

// recordName parses "<seq %020d>.json" or ".proof".
func recordName(s string) (uint64, string, bool) {
	ext := path.Ext(s)
	if ext != ".json" && ext != ".proof" {
		return 0, "", false
	}
	digits := strings.TrimSuffix(s, ext)
	n, err := strconv.ParseUint(digits, 10, 64)
	if err != nil || fmt.Sprintf("%020d", n) != digits {
		return 0, "", false
	}
	return n, ext, true
}

func validHex(s string) bool {
	if len(s) != 64 {
		return false
	}
	for _, c := range []byte(s) {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

func parseProof(b []byte) (tlog.RecordProof, error) {
	var p tlog.RecordProof
	for _, line := range strings.Split(strings.TrimSuffix(string(b), "\n"), "\n") {
		if line == "" && len(b) <= 1 {
			break // a record alone in its tree has an empty proof
		}
		h, err := tlog.ParseHash(line)
		if err != nil {
			return nil, err
		}
		p = append(p, h)
	}
	return p, nil
}

// unverifiedCheckpoint reads a checkpoint note's text without checking
// its signature.
func unverifiedCheckpoint(msg []byte) (uint64, tlog.Hash, bool) {
	text, _, ok := bytes.Cut(msg, []byte("\n\n"))
	if !ok {
		return 0, tlog.Hash{}, false
	}
	lines := strings.Split(string(text), "\n")
	if len(lines) < 3 || lines[0] == "" {
		return 0, tlog.Hash{}, false
	}
	size, err := strconv.ParseUint(lines[1], 10, 64)
	if err != nil {
		return 0, tlog.Hash{}, false
	}
	root, err := tlog.ParseHash(lines[2])
	if err != nil {
		return 0, tlog.Hash{}, false
	}
	return size, root, true
}

// manifest checks that m says what the bundle holds.
func (v *bundleVerifier) manifest(m *Manifest, entries []Entry, files *bundleFiles, cpSize uint64, cpRoot tlog.Hash, haveRoot bool, keyPub string) {
	bad := func(field, says, is string) {
		v.add(audit.Problem{Kind: ProblemManifest, Detail: fmt.Sprintf("%s: the manifest says %s, the bundle %s", field, says, is)})
	}
	if m.Format != BundleFormat {
		bad("format", strconv.Quote(m.Format), "is read as "+BundleFormat)
	}
	if m.Session == "" {
		bad("session", "nothing", "is a session's")
	}
	for i := range entries {
		e := &entries[i]
		switch {
		case e.Session != "" && e.Session != m.Session:
			v.add(audit.Problem{Kind: ProblemManifest, Seq: ptr(e.Seq), Detail: fmt.Sprintf("the record is session %s's, the manifest names session %s", clean(e.Session, maxField), clean(m.Session, maxField))})
		case e.VM != "" && e.VM != m.VM:
			v.add(audit.Problem{Kind: ProblemManifest, Seq: ptr(e.Seq), Detail: fmt.Sprintf("the record is vm %q's, the manifest names vm %q", clean(e.VM, maxField), clean(m.VM, maxField))})
		case e.Session == "" && e.VM == "":
			v.add(audit.Problem{Kind: ProblemManifest, Seq: ptr(e.Seq), Detail: "the record names neither the session nor its vm"})
		}
	}
	listed := map[uint64]bool{}
	for _, s := range m.Seqs {
		if listed[s] {
			v.add(audit.Problem{Kind: ProblemManifest, Seq: ptr(s), Detail: "listed twice in the manifest"})
		}
		listed[s] = true
		if _, ok := files.records[s]; !ok {
			v.add(audit.Problem{Kind: ProblemManifest, Seq: ptr(s), Detail: "listed in the manifest but not in the bundle: a record was removed"})
		}
	}
	for s := range files.records {
		if !listed[s] {
			v.add(audit.Problem{Kind: ProblemManifest, Seq: ptr(s), Detail: "in the bundle but not listed in the manifest: a record was added"})
		}
	}
	if m.Records != len(files.records) {
		bad("records", strconv.Itoa(m.Records), fmt.Sprintf("holds %d", len(files.records)))
	}
	if haveRoot && (m.TreeSize != cpSize || m.Root != cpRoot.String()) {
		bad("tree", fmt.Sprintf("%d records with root %s", m.TreeSize, m.Root), fmt.Sprintf("has a checkpoint of %d with root %s", cpSize, cpRoot))
	}
	if keyPub != "" && m.Key != keyPub {
		bad("key", strconv.Quote(m.Key), "holds "+strconv.Quote(keyPub))
	}
	var want Manifest
	want.describe(entries)
	if !slices.Equal(m.Blobs, want.Blobs) {
		bad("blobs", fmt.Sprintf("%d blobs", len(m.Blobs)), fmt.Sprintf("records reference %d (%s)", len(want.Blobs), diffList(m.Blobs, want.Blobs)))
	}
	for _, f := range []struct{ name, says, is string }{
		{"image_digest", m.ImageDigest, want.ImageDigest},
		{"policy", m.Policy, want.Policy},
		{"policy_revision", m.PolicyRevision, want.PolicyRevision},
	} {
		if f.says != f.is {
			bad(f.name, strconv.Quote(clean(f.says, maxField)), "records say "+strconv.Quote(clean(f.is, maxField)))
		}
	}
	if !slices.Equal(m.Policies, want.Policies) {
		bad("policies", fmt.Sprint(m.Policies), fmt.Sprintf("records name %v", want.Policies))
	}
	if len(entries) > 0 && (!m.First.Equal(want.First) || !m.Last.Equal(want.Last)) {
		bad("first and last", m.First.Format(time.RFC3339Nano)+" and "+m.Last.Format(time.RFC3339Nano),
			"records run from "+want.First.Format(time.RFC3339Nano)+" to "+want.Last.Format(time.RFC3339Nano))
	}
}

// diffList says which names one list has that the other lacks.
func diffList(says, is []string) string {
	var parts []string
	for _, d := range is {
		if !slices.Contains(says, d) {
			parts = append(parts, "unlisted "+d)
		}
	}
	for _, d := range says {
		if !slices.Contains(is, d) {
			parts = append(parts, "unreferenced "+clean(d, maxField))
		}
	}
	return strings.Join(parts, ", ")
}
