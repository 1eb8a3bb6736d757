package audit

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"
)

// A log's records are one stream, stored in segments: records.log is the
// live one, and each segment rolled out of it is renamed, whole, to
// segments/<first seq>-<last seq>.log (both %020d). The segments in order,
// concatenated, are byte for byte the records.log there would have been
// without rolling, and a record's byte offset is its offset in that
// stream. Every segment after the first begins with an "audit.segment"
// record that commits to the one before it. A rotated segment moved
// elsewhere (Archive) leaves a manifest, segments/<name>.archived, in its
// place.
const (
	segmentDir     = "segments"
	segmentExt     = ".log"
	archivedExt    = ".archived"
	segmentNameLen = 20 + 1 + 20 + len(segmentExt)
)

// Defaults of Options.SegmentBytes and Options.SegmentAge.
const (
	DefaultSegmentBytes = 128 << 20
	DefaultSegmentAge   = 24 * time.Hour
)

func segmentName(first, last uint64) string {
	return fmt.Sprintf("%020d-%020d%s", first, last, segmentExt)
}

// parseSegmentName reads a rotated segment's file name; ok is false for
// any other name.
func parseSegmentName(name string) (first, last uint64, ok bool) {
	if len(name) != segmentNameLen || !strings.HasSuffix(name, segmentExt) || name[20] != '-' {
		return 0, 0, false
	}
	first, err1 := strconv.ParseUint(name[:20], 10, 64)
	last, err2 := strconv.ParseUint(name[21:41], 10, 64)
	if err1 != nil || err2 != nil || last < first || segmentName(first, last) != name {
		return 0, 0, false
	}
	return first, last, true
}

// ArchivedSegment is the manifest a segment moved elsewhere leaves behind
// (segments/<name>.archived), and what Verify reports of it.
type ArchivedSegment struct {
	Name     string `json:"name"`
	FirstSeq uint64 `json:"first_seq"`
	LastSeq  uint64 `json:"last_seq"`
	Bytes    int64  `json:"bytes"`
	SHA256   string `json:"sha256"` // hex, of the segment file
	// ArchivedTo is the directory it was copied to, as given then.
	ArchivedTo string    `json:"archived_to"`
	ArchivedAt time.Time `json:"archived_at"`
	// Checkpoint is the signed checkpoint at its end (tree size LastSeq+1),
	// the one the next segment's first record commits to.
	Checkpoint string `json:"checkpoint"`
}

// segment is one rotated segment, present or archived.
type segment struct {
	name        string
	first, last uint64
	bytes       int64
	path        string           // its file; "" when archived
	archived    *ArchivedSegment // its manifest, if it has one
}

func (s segment) records() uint64 { return s.last - s.first + 1 }

// listSegments returns the rotated segments of the log in dir by first
// seq: those with a file (even if a manifest says they were archived:
// the copy did not finish removing them) and those with a manifest only.
// Which seqs none of them holds is for the caller to see.
func listSegments(dir string) ([]segment, error) {
	ents, err := os.ReadDir(filepath.Join(dir, segmentDir))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list segments: %w", err)
	}
	byName := map[string]*segment{}
	var segs []*segment
	get := func(name string, first, last uint64) *segment {
		if s := byName[name]; s != nil {
			return s
		}
		s := &segment{name: name, first: first, last: last}
		byName[name] = s
		segs = append(segs, s)
		return s
	}
	for _, e := range ents {
		name := e.Name()
		if first, last, ok := parseSegmentName(name); ok && e.Type().IsRegular() {
			info, err := e.Info()
			if err != nil {
				return nil, fmt.Errorf("list segments: %w", err)
			}
			s := get(name, first, last)
			s.path, s.bytes = filepath.Join(dir, segmentDir, name), info.Size()
			continue
		}
		seg, isManifest := strings.CutSuffix(name, archivedExt)
		first, last, ok := parseSegmentName(seg)
		if !isManifest || !ok {
			continue
		}
		m, err := readManifest(filepath.Join(dir, segmentDir, name))
		if err != nil {
			return nil, err
		}
		if m.Name != seg || m.FirstSeq != first || m.LastSeq != last {
			return nil, fmt.Errorf("archive manifest %s names segment %s (records %d-%d)", name, m.Name, m.FirstSeq, m.LastSeq)
		}
		s := get(seg, first, last)
		s.archived = m
		if s.path == "" {
			s.bytes = m.Bytes
		}
	}
	sort.Slice(segs, func(i, j int) bool { return segs[i].first < segs[j].first })
	out := make([]segment, len(segs))
	for i, s := range segs {
		out[i] = *s
	}
	return out, nil
}

func readManifest(path string) (*ArchivedSegment, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read archive manifest: %w", err)
	}
	var m ArchivedSegment
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("archive manifest %s: %w", filepath.Base(path), err)
	}
	return &m, nil
}

// liveStart is where records.log starts, after the rotated segments: its
// first seq and its byte offset in the stream.
func liveStart(segs []segment) (first uint64, base int64) {
	for _, s := range segs {
		base += s.bytes
	}
	if len(segs) > 0 {
		first = segs[len(segs)-1].last + 1
	}
	return first, base
}

// hole is a run of records the log's directory does not hold: archived
// (Manifest set) or missing.
type hole struct {
	first, last uint64
	manifest    *ArchivedSegment
}

// holes are the runs of records before records.log that no present
// segment file holds, in order.
func holes(segs []segment) []hole {
	var out []hole
	next := uint64(0)
	for _, s := range segs {
		if s.first > next {
			out = append(out, hole{first: next, last: s.first - 1})
		}
		if s.path == "" {
			out = append(out, hole{first: s.first, last: s.last, manifest: s.archived})
		}
		next = max(next, s.last+1)
	}
	return out
}

// part is one file of a stream.
type part struct {
	name  string // for messages: records.log or segments/NAME
	path  string
	f     *os.File // opened when first read, unless live
	base  int64
	size  int64 // -1: the live segment, whose size is its file's now
	first uint64
}

// stream reads the segment files in order as one io.ReaderAt, at the
// offsets of the whole log. It starts where its first part does: earlier
// offsets hold archived or missing records.
type stream struct {
	parts []*part
}

// newStream makes the stream of the present segments that follow the
// last hole, and records.log (live may be nil: none yet).
func newStream(segs []segment, live *os.File) *stream {
	hs := holes(segs)
	from := uint64(0)
	if len(hs) > 0 {
		from = hs[len(hs)-1].last + 1
	}
	s := &stream{}
	var base int64
	for _, sg := range segs {
		if sg.first >= from && sg.path != "" {
			s.parts = append(s.parts, &part{name: filepath.Join(segmentDir, sg.name), path: sg.path, base: base, size: sg.bytes, first: sg.first})
		}
		base += sg.bytes
	}
	if live != nil {
		first, _ := liveStart(segs)
		s.parts = append(s.parts, &part{name: recordsFile, f: live, base: base, size: -1, first: first})
	}
	return s
}

// start is the offset of the stream's first record, and its seq.
func (s *stream) start() (int64, uint64) {
	if len(s.parts) == 0 {
		return 0, 0
	}
	return s.parts[0].base, s.parts[0].first
}

// end is the offset just after the stream's last byte, now.
func (s *stream) end() (int64, error) {
	if len(s.parts) == 0 {
		return 0, nil
	}
	p := s.parts[len(s.parts)-1]
	n, err := p.len()
	return p.base + n, err
}

func (p *part) len() (int64, error) {
	if p.size >= 0 {
		return p.size, nil
	}
	st, err := p.f.Stat()
	if err != nil {
		return 0, fmt.Errorf("stat %s: %w", p.name, err)
	}
	return st.Size(), nil
}

func (p *part) file() (*os.File, error) {
	if p.f == nil {
		f, err := os.Open(p.path)
		if err != nil {
			return nil, fmt.Errorf("open segment: %w", err)
		}
		p.f = f
	}
	return p.f, nil
}

// ReadAt reads across segment files. Offsets before the stream's start,
// or in a segment shorter than its recorded size, read as io.EOF.
func (s *stream) ReadAt(b []byte, off int64) (int, error) {
	n := 0
	for n < len(b) {
		i := sort.Search(len(s.parts), func(i int) bool { return s.parts[i].base > off }) - 1
		if i < 0 {
			return n, io.EOF
		}
		p := s.parts[i]
		size, err := p.len()
		if err != nil {
			return n, err
		}
		if off >= p.base+size {
			return n, io.EOF
		}
		f, err := p.file()
		if err != nil {
			return n, err
		}
		want := b[n:min(len(b), n+int(p.base+size-off))]
		k, err := f.ReadAt(want, off-p.base)
		n += k
		off += int64(k)
		if err != nil && !errors.Is(err, io.EOF) {
			return n, err
		}
		if k < len(want) {
			return n, io.EOF
		}
	}
	return n, nil
}

// Close closes the segment files the stream opened, and the live one.
func (s *stream) Close() error {
	var errs []error
	for _, p := range s.parts {
		if p.f != nil {
			errs = append(errs, p.f.Close())
			p.f = nil
		}
	}
	return errors.Join(errs...)
}

// openStream opens the log's segments for reading, as they are now. A
// segment rolled (or archived) while it lists them makes it list again.
func openStream(dir string) (*stream, []segment, error) {
	for range 10 {
		segs, err := listSegments(dir)
		if err != nil {
			return nil, nil, err
		}
		live, err := os.Open(filepath.Join(dir, recordsFile))
		if err != nil && !(errors.Is(err, fs.ErrNotExist) && len(segs) > 0) {
			return nil, nil, err // a log rolled but not yet started again has no records.log for a moment
		}
		again, err := listSegments(dir)
		if err != nil {
			if live != nil {
				live.Close()
			}
			return nil, nil, err
		}
		if sameSegments(segs, again) {
			return newStream(segs, live), segs, nil
		}
		if live != nil {
			live.Close()
		}
	}
	return nil, nil, fmt.Errorf("open audit log %s: its segments keep changing", dir)
}

func sameSegments(a, b []segment) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].name != b[i].name || a[i].path != b[i].path {
			return false
		}
	}
	return true
}
