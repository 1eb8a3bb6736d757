package audit

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"
)

// VerifyOptions tune Verify.
type VerifyOptions struct {
	// Key is the verifier key the checkpoints must be signed with. Empty
	// means key.pub in the log's directory, which proves less: whoever
	// can rewrite the log can rewrite key.pub.
	Key string
	// Checkpoints are more signed checkpoints to hold the log to, such as
	// ones a reviewer kept from earlier; a log cut back below one of them
	// is reported even when its own checkpoints were cut too.
	Checkpoints [][]byte
	// SkipBlobs skips hashing the blobs records reference.
	SkipBlobs bool
	// MaxProblems caps the problems listed (default 1000); the rest are
	// counted in Report.Omitted.
	MaxProblems int
	// Witnesses are the keys of witnesses whose cosignatures the log's
	// checkpoints must carry (witness.NewVerifier): every cosignature of
	// theirs must verify, and the newest checkpoint must have Quorum of
	// them (default: 1), or the log's end is reported unwitnessed.
	Witnesses []note.Verifier
	Quorum    int
	// Archive is a directory holding archived segments (carrel audit
	// archive --to): those whose content matches their manifest are
	// read from there, so that the check covers them too.
	Archive string
}

// ProblemKind classifies what Verify found.
type ProblemKind string

const (
	ProblemFrame               ProblemKind = "frame"                // bytes that are not a frame, in mid-log
	ProblemCRC                 ProblemKind = "crc"                  // a frame whose payload fails its CRC
	ProblemRecord              ProblemKind = "record"               // a payload that is not a valid record
	ProblemSeq                 ProblemKind = "seq"                  // records missing, repeated or out of order
	ProblemIntent              ProblemKind = "intent"               // an outcome without its intent
	ProblemTornTail            ProblemKind = "torn-tail"            // an incomplete last frame (a crash; Open cuts it)
	ProblemTruncated           ProblemKind = "truncated"            // a checkpoint covers more records than there are
	ProblemCheckpointSignature ProblemKind = "checkpoint-signature" // a checkpoint that does not verify or parse
	ProblemCheckpointRoot      ProblemKind = "checkpoint-root"      // a checkpoint whose root the records do not reproduce
	ProblemCosignature         ProblemKind = "cosignature"          // a witness's cosignature that does not verify: the checkpoint is not what it cosigned
	ProblemUnwitnessed         ProblemKind = "unwitnessed"          // the log's newest checkpoint lacks a quorum of cosignatures
	ProblemSealed              ProblemKind = "sealed"               // a sealed log that does not match its recovery record
	ProblemBlobMissing         ProblemKind = "blob-missing"
	ProblemBlobMismatch        ProblemKind = "blob-mismatch" // a blob whose content does not hash to its name
	// A segment that does not chain to the one before it, records in no
	// segment and no archive manifest, or an archived copy that does not
	// match its manifest.
	ProblemSegment ProblemKind = "segment"
)

// Problem is one thing wrong with a log, with its position: a record
// (Seq, its index in the log, and Offset, its byte offset in the log's
// segments laid end to end), a
// checkpoint (its tree size) or a blob (its digest).
type Problem struct {
	Kind       ProblemKind `json:"kind"`
	Seq        *uint64     `json:"seq,omitempty"`
	Offset     *int64      `json:"offset,omitempty"`
	Checkpoint *uint64     `json:"checkpoint,omitempty"`
	Blob       string      `json:"blob,omitempty"`
	Detail     string      `json:"detail"`
}

func (p Problem) String() string {
	s := string(p.Kind)
	if p.Seq != nil {
		s += fmt.Sprintf(" record %d", *p.Seq)
	}
	if p.Offset != nil {
		s += fmt.Sprintf(" offset %d", *p.Offset)
	}
	if p.Checkpoint != nil {
		s += fmt.Sprintf(" checkpoint %d", *p.Checkpoint)
	}
	if p.Blob != "" {
		s += " blob " + p.Blob
	}
	return s + ": " + p.Detail
}

// Report is what Verify found.
type Report struct {
	Records uint64    `json:"records"` // the tree's size: records read, and those before From
	Bytes   int64     `json:"bytes"`   // size of the log, all its segments
	Root    tlog.Hash `json:"root"`    // tree hash over all records
	// Segments is how many segments the log has, records.log and
	// archived ones included. From is the first record read: the ones
	// before it are in Archived (or missing: a problem), and were checked
	// only through the signed checkpoint at From, which the tree in
	// hashes.db must reproduce.
	Segments    int               `json:"segments"`
	From        uint64            `json:"from,omitempty"`
	Archived    []ArchivedSegment `json:"archived,omitempty"`
	Checkpoints int               `json:"checkpoints"`
	// Latest is the largest checkpoint whose signature and root verified.
	Latest      uint64    `json:"latest"`
	Blobs       int       `json:"blobs"`        // distinct blobs referenced
	OpenIntents int       `json:"open_intents"` // intents without an outcome (in flight, if the log is live)
	KeyFromLog  bool      `json:"key_from_log"` // the key came from the log's own key.pub
	Problems    []Problem `json:"problems"`
	Omitted     int       `json:"omitted,omitempty"` // problems beyond MaxProblems
	// With witnesses: the largest checkpoint with a quorum of valid
	// cosignatures, and the checkpoints (sizes, at most 100) without one.
	Witnessed   uint64   `json:"witnessed,omitempty"`
	Unwitnessed []uint64 `json:"unwitnessed,omitempty"`
	// Sealed are the damaged logs carrel audit recover sealed (below
	// sealed/), each checked: its records and the ones it cannot read.
	Sealed []SealedReport `json:"sealed,omitempty"`
}

// SealedReport is a sealed log, as Verify found it.
type SealedReport struct {
	Dir        string   `json:"dir"` // relative to the log's directory
	Records    uint64   `json:"records"`
	Latest     uint64   `json:"latest"` // its last checkpoint that verified
	Unreadable []uint64 `json:"unreadable"`
}

// OK reports whether Verify found nothing wrong.
func (r *Report) OK() bool { return len(r.Problems) == 0 && r.Omitted == 0 }

type verifyCheckpoint struct {
	size uint64
	root tlog.Hash
	name string
	msg  []byte
	own  bool // the log's, not one the reviewer gave
}

// Verify checks the log in dir offline, without writing to it: every
// frame's CRC, every record's seq, the tree root at every checkpoint
// (which also proves consecutive checkpoints consistent), every
// checkpoint's signature, every referenced blob's content, and that each
// segment's first record commits to the segment before it. Archived
// segments are checked through the signed checkpoint at their end, or,
// with opts.Archive, read from there. It returns
// an error only when it cannot do that (no log, no key, I/O errors);
// what it finds wrong is in Report.Problems.
func Verify(dir string, opts VerifyOptions) (*Report, error) {
	if opts.MaxProblems <= 0 {
		opts.MaxProblems = 1000
	}
	rep := &Report{Problems: []Problem{}}
	v := &verifier{dir: dir, rep: rep, max: opts.MaxProblems}
	key := opts.Key
	if key == "" {
		k, err := PublicKey(dir)
		if err != nil {
			return nil, fmt.Errorf("verify audit log: %w", err)
		}
		key, rep.KeyFromLog = k, true
	}
	nv, err := note.NewVerifier(key)
	if err != nil {
		return nil, fmt.Errorf("verify audit log: verifier key: %w", err)
	}
	cps, err := v.checkpoints(note.VerifierList(nv), opts.Checkpoints)
	if err != nil {
		return nil, err
	}
	if len(opts.Witnesses) > 0 {
		if err := v.witnessed(nv, opts.Witnesses, max(opts.Quorum, 1), cps); err != nil {
			return nil, err
		}
	}
	v.vs = note.VerifierList(nv)
	src, err := v.segments(opts.Archive)
	if err != nil {
		return nil, fmt.Errorf("verify audit log: %w", err)
	}
	defer src.Close()
	if err := v.records(src, cps); err != nil {
		return nil, fmt.Errorf("verify audit log: %w", err)
	}
	if !opts.SkipBlobs {
		v.blobs()
	}
	if err := v.sealed(key); err != nil {
		return nil, err
	}
	return rep, nil
}

// sealed checks the logs carrel audit recover sealed, and the chain from
// each to the log that followed it: the follower's first record is the
// recovery that names it, with its last good checkpoint. Damage the
// recovery recorded is reported as the sealed log's unreadable records;
// anything else is a problem.
func (v *verifier) sealed(key string) error {
	ents, err := os.ReadDir(filepath.Join(v.dir, sealedDir))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("verify audit log: %w", err)
	}
	first, err := firstRecovery(v.dir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		rel := filepath.Join(sealedDir, e.Name())
		rep, err := Verify(filepath.Join(v.dir, rel), VerifyOptions{Key: key, SkipBlobs: true})
		if err != nil {
			v.add(Problem{Kind: ProblemSealed, Detail: fmt.Sprintf("%s: %v", rel, err)})
			continue
		}
		sr := SealedReport{Dir: rel, Records: rep.Records, Latest: rep.Latest, Unreadable: rep.Unreadable()}
		v.rep.Sealed = append(v.rep.Sealed, sr)
		// Only the newest sealed log is the one the live log follows;
		// older ones were followed by logs sealed since, which this
		// verify does not chain (each says so in its own first record).
		if first == nil || first.Sealed != rel {
			continue
		}
		if !slices.Equal(first.Unreadable, sr.Unreadable) {
			v.add(Problem{Kind: ProblemSealed, Detail: fmt.Sprintf("%s: records %v are unreadable now, %v were when it was sealed", rel, sr.Unreadable, first.Unreadable)})
		}
		if first.PreviousCheckpoint != "" {
			cp, err := parseCheckpoint([]byte(first.PreviousCheckpoint), mustVerifiers(key))
			switch {
			case err != nil:
				v.add(Problem{Kind: ProblemSealed, Detail: fmt.Sprintf("%s: the checkpoint the recovery chains to: %v", rel, err)})
			case cp.Size != rep.Latest:
				v.add(Problem{Kind: ProblemSealed, Detail: fmt.Sprintf("%s: the recovery chains to its checkpoint at %d records; its last good one is at %d", rel, cp.Size, rep.Latest)})
			}
		}
	}
	return nil
}

func mustVerifiers(key string) note.Verifiers {
	nv, err := note.NewVerifier(key)
	if err != nil {
		return note.VerifierList()
	}
	return note.VerifierList(nv)
}

// firstRecovery is the log's first record's data when that is a recovery
// of cause corruption, else nil.
func firstRecovery(dir string) (*RecoveryData, error) {
	r, err := OpenReader(dir)
	if err != nil {
		return nil, fmt.Errorf("verify audit log: %w", err)
	}
	defer r.Close()
	var out *RecoveryData
	stop := errors.New("stop")
	_, err = r.Scan(func(seq uint64, _ int64, payload []byte) error {
		rec, err := Decode(payload)
		if err == nil && rec.Kind == KindRecovery {
			var d RecoveryData
			if json.Unmarshal(rec.Data, &d) == nil && d.Cause == "corruption" {
				out = &d
			}
		}
		return stop
	})
	if err != nil && !errors.Is(err, stop) {
		return nil, fmt.Errorf("verify audit log: %w", err)
	}
	return out, nil
}

type verifier struct {
	dir string
	rep *Report
	max int
	vs  note.Verifiers
	// The segments' starts, where an audit.segment record is due.
	bounds []boundary
	// blob references, and the first record to make each
	refs map[string]uint64

	// The combiner's state, in record order.
	tree     tree
	cps      []verifyCheckpoint // not yet reached
	expect   uint64             // the next seq due
	lastGood uint64             // size of the last checkpoint that matched
	base     uint64             // the first record read
	isIntent []uint64           // bitmap by record index from base
	before   map[uint64]bool    // intents before base left open there
	open     map[uint64]struct{}
}

func (v *verifier) add(p Problem) {
	if len(v.rep.Problems) < v.max {
		v.rep.Problems = append(v.rep.Problems, p)
	} else {
		v.rep.Omitted++
	}
}

func ptr[T any](x T) *T { return &x }

// checkpoints reads and checks the signatures of the log's checkpoints
// and the extra ones, and returns those that verify, by size.
func (v *verifier) checkpoints(vs note.Verifiers, extra [][]byte) ([]verifyCheckpoint, error) {
	stored, err := storedCheckpoints(v.dir)
	if err != nil {
		return nil, fmt.Errorf("verify audit log: %w", err)
	}
	var cps []verifyCheckpoint
	for i, sc := range stored {
		if i > 0 && stored[i-1].size == sc.size {
			continue // in the pack and in its file: a pack cut short by a crash
		}
		size, name, msg := sc.size, sc.name, sc.msg
		v.rep.Checkpoints++
		cp, err := parseCheckpoint(msg, vs)
		switch {
		case err != nil:
			v.add(Problem{Kind: ProblemCheckpointSignature, Checkpoint: ptr(size), Detail: fmt.Sprintf("%s: %v", name, err)})
		case cp.Size != size:
			v.add(Problem{Kind: ProblemCheckpointSignature, Checkpoint: ptr(size), Detail: fmt.Sprintf("%s is signed for %d records", name, cp.Size)})
		default:
			cps = append(cps, verifyCheckpoint{cp.Size, cp.Root, name, msg, true})
		}
	}
	for i, msg := range extra {
		v.rep.Checkpoints++
		name := fmt.Sprintf("given checkpoint #%d", i+1)
		cp, err := parseCheckpoint(msg, vs)
		if err != nil {
			v.add(Problem{Kind: ProblemCheckpointSignature, Detail: fmt.Sprintf("%s: %v", name, err)})
			continue
		}
		cps = append(cps, verifyCheckpoint{cp.Size, cp.Root, name, msg, false})
	}
	sort.SliceStable(cps, func(i, j int) bool { return cps[i].size < cps[j].size })
	return cps, nil
}

// witnessed checks the witnesses' cosignatures on the log's checkpoints
// that verified (cps): each must verify, and the newest must have a
// quorum.
func (v *verifier) witnessed(host note.Verifier, witnesses []note.Verifier, quorum int, cps []verifyCheckpoint) error {
	var newest uint64
	for _, cp := range cps {
		if !cp.own {
			continue // one given by the reviewer, not the log's
		}
		newest = max(newest, cp.size)
		c, err := CheckCosignatures(cp.msg, host, witnesses)
		if err != nil {
			v.add(Problem{Kind: ProblemCosignature, Checkpoint: ptr(cp.size), Detail: fmt.Sprintf("%s: %v", cp.name, err)})
			continue
		}
		for _, name := range c.Invalid {
			v.add(Problem{Kind: ProblemCosignature, Checkpoint: ptr(cp.size), Detail: fmt.Sprintf(
				"%s: the cosignature of witness %s does not match: the checkpoint is not the one the witness cosigned (rewritten and signed again?)", cp.name, name)})
		}
		if len(c.Invalid) > 0 {
			continue
		}
		got := len(c.Valid)
		if got >= quorum {
			v.rep.Witnessed = max(v.rep.Witnessed, cp.size)
		} else if len(v.rep.Unwitnessed) < 100 {
			v.rep.Unwitnessed = append(v.rep.Unwitnessed, cp.size)
		}
	}
	if newest > 0 && v.rep.Witnessed < newest {
		from := "none of its checkpoints has"
		if v.rep.Witnessed > 0 {
			from = fmt.Sprintf("the last with %d is at %d records", quorum, v.rep.Witnessed)
		}
		v.add(Problem{Kind: ProblemUnwitnessed, Checkpoint: ptr(newest), Detail: fmt.Sprintf(
			"the newest checkpoint, at %d records, lacks %d valid cosignatures (%s): what follows is vouched for by the host's key alone", newest, quorum, from)})
	}
	return nil
}

// blobs checks that every referenced blob is there, unchanged.
func (v *verifier) blobs() {
	digests := slices.Sorted(func(yield func(string) bool) {
		for d := range v.refs {
			if !yield(d) {
				return
			}
		}
	})
	v.rep.Blobs = len(digests)
	for _, d := range digests {
		err := checkBlob(v.dir, d)
		switch {
		case err == nil:
		case errors.Is(err, fs.ErrNotExist):
			v.add(Problem{Kind: ProblemBlobMissing, Seq: ptr(v.refs[d]), Blob: d, Detail: "referenced by this record and later ones, but not in blobs/"})
		default:
			v.add(Problem{Kind: ProblemBlobMismatch, Seq: ptr(v.refs[d]), Blob: d, Detail: err.Error()})
		}
	}
}
