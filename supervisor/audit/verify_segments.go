package audit

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"

	"golang.org/x/mod/sumdb/tlog"
)

// boundary is where a segment starts, after the first: its first record
// must be an audit.segment that commits to prev (nil: a segment not in
// the directory, archived without a manifest or missing).
type boundary struct {
	off  int64
	seq  uint64
	name string
	prev *segment
}

// segments lists the log's segments, reports those it cannot read
// (archived, or missing: a problem), and returns the stream of those it
// reads: the ones after the last it cannot. Archived segments found in
// archive, whole, are read from there.
func (v *verifier) segments(archive string) (*stream, error) {
	segs, err := listSegments(v.dir)
	if err != nil {
		return nil, err
	}
	live, err := os.Open(filepath.Join(v.dir, recordsFile))
	if err != nil && !(errors.Is(err, fs.ErrNotExist) && len(segs) > 0) {
		return nil, err
	}
	v.rep.Segments = len(segs) + 1
	for i := range segs {
		s := &segs[i]
		if s.path != "" || s.archived == nil {
			continue
		}
		m := s.archived
		if cp, err := parseCheckpoint([]byte(m.Checkpoint), v.vs); err != nil || cp.Size != m.LastSeq+1 {
			detail := fmt.Sprintf("archived segment %s: its manifest's checkpoint is not the signed one at %d records", s.name, m.LastSeq+1)
			if err != nil {
				detail += ": " + err.Error()
			}
			v.add(Problem{Kind: ProblemSegment, Seq: ptr(m.FirstSeq), Detail: detail})
		}
		if archive == "" {
			continue
		}
		path := filepath.Join(archive, s.name)
		switch sum, n, err := fileSHA256(path); {
		case errors.Is(err, fs.ErrNotExist):
		case err != nil:
			return nil, err
		case sum != m.SHA256 || n != m.Bytes:
			v.add(Problem{Kind: ProblemSegment, Seq: ptr(m.FirstSeq), Detail: fmt.Sprintf(
				"the archived copy %s does not match its manifest: %d bytes, sha256 %s; the manifest says %d bytes, sha256 %s", path, n, sum, m.Bytes, m.SHA256)})
		default:
			s.path = path
		}
	}
	for _, h := range holes(segs) {
		if h.manifest != nil {
			v.rep.Archived = append(v.rep.Archived, *h.manifest)
			continue
		}
		v.add(Problem{Kind: ProblemSegment, Seq: ptr(h.first), Detail: fmt.Sprintf(
			"records %d to %d are missing: no segment file holds them, and no archive manifest says where they went", h.first, h.last)})
	}
	src := newStream(segs, live)
	bySeq := map[uint64]*segment{}
	for i := range segs {
		bySeq[segs[i].last+1] = &segs[i]
	}
	for _, p := range src.parts {
		if p.first > 0 {
			v.bounds = append(v.bounds, boundary{off: p.base, seq: p.first, name: p.name, prev: bySeq[p.first]})
		}
	}
	return src, nil
}

// fileSHA256 is the hex sha256 of the file at path, and its size.
func fileSHA256(path string) (string, int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return "", 0, err
	}
	return hex.EncodeToString(h.Sum(nil)), n, nil
}

// boot starts the tree at first, the first record read, from hashes.db:
// the records before it are not there to hash. The first segment's
// audit.segment record then holds the tree to the signed checkpoint at
// first (segmentStart). The log's checkpoints below first are checked
// against that tree by consistency proofs from hashes.db. It reports false
// when hashes.db does not hold the tree.
func (v *verifier) boot(first uint64) bool {
	f, err := os.Open(filepath.Join(v.dir, hashesFile))
	if err == nil {
		defer f.Close()
	}
	var t *tree
	if err == nil {
		t, err = loadTree(first, hashFile{osFile{f}})
	}
	if err != nil {
		v.add(Problem{Kind: ProblemSegment, Seq: ptr(first), Detail: fmt.Sprintf(
			"records before %d are not here, and hashes.db does not hold their tree (%v): nothing after them can be checked; give the archived segments with --archive", first, err)})
		return false
	}
	v.tree = *t
	root := t.root()
	hr := hashFile{osFile{f}}
	for len(v.cps) > 0 && v.cps[0].size <= first {
		cp := v.cps[0]
		v.cps = v.cps[1:]
		ok := cp.size == first && cp.root == root
		if cp.size < first {
			proof, err := tlog.ProveTree(int64(first), int64(cp.size), hr)
			ok = err == nil && tlog.CheckTree(proof, int64(first), root, int64(cp.size), cp.root) == nil
		}
		if !ok {
			v.add(Problem{Kind: ProblemCheckpointRoot, Checkpoint: ptr(cp.size), Detail: fmt.Sprintf(
				"%s: not consistent with the tree of the %d records before the first segment here, as hashes.db holds it", cp.name, first)})
			continue
		}
		v.lastGood = cp.size
		v.rep.Latest = max(v.rep.Latest, cp.size)
	}
	return true
}

// segmentStart checks the first record of a segment, at pos, before its
// leaf joins the tree: an audit.segment whose checkpoint is signed, at
// pos, with the tree's root now, and which describes the segment before.
func (v *verifier) segmentStart(c *vchunk, it *vitem, pos uint64) {
	b := v.bounds[0]
	v.bounds = v.bounds[1:]
	at := func(detail string, args ...any) {
		v.add(Problem{Kind: ProblemSegment, Seq: ptr(pos), Offset: ptr(it.off), Detail: b.name + ": " + fmt.Sprintf(detail, args...)})
	}
	if b.off != it.off {
		at("no record starts the segment, at byte %d", b.off)
		return
	}
	rec, err := Decode(c.data[it.start:it.end])
	if err != nil || rec.Kind != KindSegment {
		at("its first record is not an %s record", KindSegment)
		return
	}
	var d SegmentStart
	if err := json.Unmarshal(rec.Data, &d); err != nil {
		at("its %s record: %v", KindSegment, err)
		return
	}
	if p := b.prev; p != nil && (d.Previous != p.name || d.Records != p.records() || d.Bytes != p.bytes) {
		at("its first record says the segment before is %s, %d records, %d bytes; it is %s, %d records, %d bytes",
			d.Previous, d.Records, d.Bytes, p.name, p.records(), p.bytes)
	}
	cp, err := parseCheckpoint([]byte(d.Checkpoint), v.vs)
	switch {
	case err != nil:
		at("the checkpoint its first record commits to: %v", err)
	case cp.Size != pos:
		at("its first record commits to the checkpoint at %d records, not at %d", cp.Size, pos)
	case cp.Root != v.tree.root():
		at("the records before it hash to %s, the checkpoint its first record commits to says %s", v.tree.root(), cp.Root)
	default:
		v.lastGood = cp.Size
		v.rep.Latest = max(v.rep.Latest, cp.Size)
	}
	refs, err := d.intents(v.dir)
	if err != nil {
		at("%v", err)
		return
	}
	if pos == v.base {
		for _, in := range refs {
			v.before[in.Seq] = true
			v.open[in.Seq] = struct{}{}
		}
		return
	}
	open := slices.Sorted(maps.Keys(v.open))
	listed := make([]uint64, len(refs))
	for i, in := range refs {
		listed[i] = in.Seq
	}
	if !slices.Equal(open, listed) {
		at("its first record lists intents %v as open; the records before it leave %v open", firstOf(listed), firstOf(open))
	}
}

// firstOf shortens a list of seqs for a message.
func firstOf(s []uint64) []uint64 {
	if len(s) > 20 {
		return s[:20]
	}
	return s
}
