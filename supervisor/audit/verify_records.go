package audit

import (
	"errors"
	"fmt"
	"io"
	"runtime"
	"sync"

	"golang.org/x/mod/sumdb/tlog"

	"github.com/carrel-os/carrel/supervisor/cas"
)

// Verify reads records.log once, in three stages: one goroutine reads
// frames and checks CRCs, workers hash leaves and parse records in
// parallel, chunk by chunk, and a combiner takes the chunks in order to
// build the tree and check seqs, intents and checkpoint roots.

const chunkBytes = 1 << 20

// vitem is one record (or a problem found between records) in a chunk.
type vitem struct {
	off        int64
	start, end int      // the payload in vchunk.data
	problem    *Problem // a reader's problem instead of a record
	crcBad     bool
	crcDetail  string

	// Set by a worker.
	leaf      tlog.Hash
	parsed    bool
	validKP   bool // kind and provenance
	segment   bool // an audit.segment
	kind      string
	prov      string
	seq       uint64
	intent    bool // an action.intent
	hasIntent bool
	outcomeOf uint64
	blobs     []string
}

type vchunk struct {
	data  []byte
	items []vitem
	done  chan struct{}
}

// Chunks grow as needed (items refer to data by offset) and are reused.
var chunkPool = sync.Pool{New: func() any { return &vchunk{} }}

func newChunk() *vchunk {
	c := chunkPool.Get().(*vchunk)
	c.data, c.items, c.done = c.data[:0], c.items[:0], make(chan struct{})
	return c
}

// work hashes and parses a chunk's records.
func (c *vchunk) work(lh *leafHasher, h *header) {
	for i := range c.items {
		it := &c.items[i]
		if it.problem != nil {
			continue
		}
		p := c.data[it.start:it.end]
		it.leaf = lh.sum(p)
		it.parsed = parseHeader(p, h) == nil && h.validData()
		if !it.parsed {
			continue
		}
		it.seq = h.seq
		kind, prov := h.kind, Provenance(h.provenance)
		it.validKP = validKind(string(kind)) && (prov == Host || prov == Guest)
		if !it.validKP {
			it.kind, it.prov = string(kind), string(prov)
		}
		it.intent = string(kind) == KindIntent
		it.segment = string(kind) == KindSegment
		it.hasIntent, it.outcomeOf = h.hasIntent, h.intent
		it.blobs = nil
		if len(h.blobs) > 0 {
			it.blobs = append([]string(nil), h.blobs...)
		}
	}
}

func (v *verifier) records(src *stream, cps []verifyCheckpoint) error {
	v.cps, v.open, v.refs, v.before = cps, map[uint64]struct{}{}, map[string]uint64{}, map[uint64]bool{}
	start, first := src.start()
	size, err := src.end()
	if err != nil {
		return err
	}
	v.rep.Bytes, v.base, v.expect, v.rep.From = size, first, first, first
	if first > 0 && !v.boot(first) {
		return nil
	}
	workers := max(1, runtime.GOMAXPROCS(0))
	work := make(chan *vchunk, 2*workers)
	order := make(chan *vchunk, 4*workers)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			lh, h := newLeafHasher(), &header{}
			for c := range work {
				c.work(lh, h)
				close(c.done)
			}
		})
	}
	combined := make(chan struct{})
	go func() {
		defer close(combined)
		for c := range order {
			<-c.done
			v.combine(c)
			chunkPool.Put(c)
		}
	}()
	err = v.read(src, start, first, size, func(c *vchunk) {
		work <- c
		order <- c
	})
	close(work)
	close(order)
	wg.Wait()
	<-combined
	if err != nil {
		return err
	}
	for _, cp := range v.cps {
		v.add(Problem{Kind: ProblemTruncated, Checkpoint: ptr(cp.size),
			Detail: fmt.Sprintf("%s covers %d records, the log holds %d: records were cut off the end", cp.name, cp.size, v.tree.n)})
	}
	v.rep.Records = v.tree.n
	v.rep.Root = v.tree.root()
	v.rep.OpenIntents = len(v.open)
	return nil
}

// read splits the log's frames from start into chunks, resynchronizing
// after bad ones.
func (v *verifier) read(f io.ReaderAt, start int64, first uint64, size int64, emit func(*vchunk)) error {
	fr := newFrameReader(f, size)
	fr.seek(start)
	c := newChunk()
	n := first // the record due next
	flush := func() {
		if len(c.items) > 0 {
			emit(c)
			c = newChunk()
		}
	}
	defer flush()
	addRecord := func(p []byte, off int64, crcDetail string) {
		start := len(c.data)
		c.data = append(c.data, p...)
		c.items = append(c.items, vitem{off: off, start: start, end: len(c.data), crcBad: crcDetail != "", crcDetail: crcDetail})
		n++
		if len(c.data) >= chunkBytes {
			flush()
		}
	}
	for {
		p, off, err := fr.next()
		if err == io.EOF {
			return nil
		}
		var fe *frameError
		if !errors.As(err, &fe) {
			if err != nil {
				return err
			}
			addRecord(p, off, "")
			continue
		}
		end := off + int64(frameHeaderSize+fe.n)
		next := end
		if !fe.crc || end != size {
			if next, err = fr.resync(off); err != nil {
				return err
			}
		}
		switch {
		case fe.crc && next == end:
			// A damaged payload in a frame whose length is intact: keep
			// it as the record at this position, so later ones keep theirs.
			detail := "the payload does not match its CRC: a changed byte"
			if end == size {
				detail += " (or, if the log crashed, a torn last write, which Open cuts)"
			}
			payload := make([]byte, fe.n)
			if _, err := f.ReadAt(payload, off+frameHeaderSize); err != nil {
				return fmt.Errorf("read the log at %d: %w", off, err)
			}
			addRecord(payload, off, detail)
		case next < 0:
			c.items = append(c.items, vitem{off: off, problem: &Problem{Kind: ProblemTornTail, Seq: ptr(n), Offset: ptr(off),
				Detail: fmt.Sprintf("the last %d bytes are not a whole record (%s): a crash's torn tail, which Open cuts", size-off, fe.reason)}})
			return nil
		default:
			c.items = append(c.items, vitem{off: off, problem: &Problem{Kind: ProblemFrame, Seq: ptr(n), Offset: ptr(off),
				Detail: fmt.Sprintf("%d bytes before the next good frame are not a record (%s)", next-off, fe.reason)}})
		}
		fr.seek(next)
	}
}

// combine takes a chunk's records in order.
func (v *verifier) combine(c *vchunk) {
	for i := range c.items {
		it := &c.items[i]
		if it.problem != nil {
			v.add(*it.problem)
			continue
		}
		pos := v.tree.n
		if len(v.bounds) > 0 && v.bounds[0].off <= it.off {
			v.segmentStart(c, it, pos)
		} else if it.segment {
			v.add(Problem{Kind: ProblemSegment, Seq: ptr(pos), Offset: ptr(it.off), Detail: "an audit.segment record that does not start a segment"})
		}
		v.tree.push(it.leaf, nil)
		at := func(kind ProblemKind, detail string) {
			v.add(Problem{Kind: kind, Seq: ptr(pos), Offset: ptr(it.off), Detail: detail})
		}
		if it.crcBad {
			at(ProblemCRC, it.crcDetail)
		}
		if !it.parsed {
			at(ProblemRecord, "not a JSON record with a seq")
		} else {
			v.checkRecord(it, pos, at)
		}
		for len(v.cps) > 0 && v.cps[0].size == v.tree.n {
			cp := v.cps[0]
			v.cps = v.cps[1:]
			if root := v.tree.root(); root != cp.root {
				v.add(Problem{Kind: ProblemCheckpointRoot, Checkpoint: ptr(cp.size),
					Detail: fmt.Sprintf("%s: records 0..%d hash to %s, the checkpoint says %s: a record after %d was changed, removed or moved", cp.name, cp.size-1, root, cp.root, v.lastGood)})
			} else {
				v.lastGood = cp.size
				v.rep.Latest = max(v.rep.Latest, cp.size)
			}
		}
	}
}

func (v *verifier) checkRecord(it *vitem, pos uint64, at func(ProblemKind, string)) {
	if !it.validKP {
		at(ProblemRecord, fmt.Sprintf("kind %q, provenance %q", it.kind, it.prov))
	}
	switch {
	case it.seq == v.expect:
		v.expect++
	case it.seq > v.expect:
		at(ProblemSeq, fmt.Sprintf("found seq %d where %d was due: records %d..%d are missing", it.seq, v.expect, v.expect, it.seq-1))
		v.expect = it.seq + 1
	default:
		at(ProblemSeq, fmt.Sprintf("found seq %d where %d was due: out of order or repeated", it.seq, v.expect))
	}
	if it.intent {
		i := pos - v.base
		for uint64(len(v.isIntent)) <= i/64 {
			v.isIntent = append(v.isIntent, 0)
		}
		v.isIntent[i/64] |= 1 << (i % 64)
		v.open[pos] = struct{}{}
	}
	if it.hasIntent {
		in := it.outcomeOf
		if in >= pos || !v.wasIntent(in) {
			at(ProblemIntent, fmt.Sprintf("outcome of record %d, which is not an earlier intent", in))
		} else if _, ok := v.open[in]; !ok {
			at(ProblemIntent, fmt.Sprintf("a second outcome of intent %d", in))
		} else {
			delete(v.open, in)
		}
	}
	for _, d := range it.blobs {
		if !cas.Valid(d) {
			at(ProblemRecord, fmt.Sprintf("blob reference %q", d))
		} else if _, ok := v.refs[d]; !ok {
			v.refs[d] = pos
		}
	}
}

// wasIntent says whether record in, before the current one, is an intent.
func (v *verifier) wasIntent(in uint64) bool {
	if in < v.base {
		return v.before[in]
	}
	i := in - v.base
	return i/64 < uint64(len(v.isIntent)) && v.isIntent[i/64]&(1<<(i%64)) != 0
}
