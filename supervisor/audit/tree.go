package audit

import (
	"crypto/sha256"
	"fmt"
	"hash"
	"math/bits"

	"golang.org/x/mod/sumdb/tlog"
)

// tree is the right edge of the Merkle tree over n leaves: the roots of
// its perfect subtrees, largest first (a compact range). Appending a leaf
// costs one leaf hash and on average one node hash, and yields the same
// stored hashes, in the same order, as tlog.StoredHashes.
type tree struct {
	n     uint64
	stack []tlog.Hash
}

// push adds leaf n and appends the hashes tlog stores for it to stored.
func (t *tree) push(leaf tlog.Hash, stored []tlog.Hash) []tlog.Hash {
	stored = append(stored, leaf)
	t.stack = append(t.stack, leaf)
	for i := t.n; i&1 == 1; i >>= 1 {
		k := len(t.stack)
		h := tlog.NodeHash(t.stack[k-2], t.stack[k-1])
		t.stack[k-2] = h
		t.stack = t.stack[:k-1]
		stored = append(stored, h)
	}
	t.n++
	return stored
}

// root is the RFC 6962 tree hash (tlog.TreeHash) of the n leaves.
func (t *tree) root() tlog.Hash {
	if len(t.stack) == 0 {
		return sha256.Sum256(nil)
	}
	h := t.stack[len(t.stack)-1]
	for i := len(t.stack) - 2; i >= 0; i-- {
		h = tlog.NodeHash(t.stack[i], h)
	}
	return h
}

// compactIndexes are the stored-hash indexes of the compact range over
// [0, n), largest subtree first.
func compactIndexes(n uint64) []int64 {
	var idx []int64
	var lo uint64
	for b := 63; b >= 0; b-- {
		if n&(1<<b) != 0 {
			idx = append(idx, tlog.StoredHashIndex(b, int64(lo>>b)))
			lo += 1 << b
		}
	}
	return idx
}

// loadTree reads the compact range over n leaves from stored hashes.
func loadTree(n uint64, r tlog.HashReader) (*tree, error) {
	hs, err := r.ReadHashes(compactIndexes(n))
	if err != nil {
		return nil, err
	}
	if len(hs) != bits.OnesCount64(n) {
		return nil, fmt.Errorf("read %d hashes, want %d", len(hs), bits.OnesCount64(n))
	}
	return &tree{n: n, stack: hs}, nil
}

// leafHasher is tlog.RecordHash without allocating.
type leafHasher struct{ h hash.Hash }

func newLeafHasher() *leafHasher { return &leafHasher{sha256.New()} }

var zeroPrefix = []byte{0}

func (l *leafHasher) sum(p []byte) (out tlog.Hash) {
	l.h.Reset()
	l.h.Write(zeroPrefix)
	l.h.Write(p)
	l.h.Sum(out[:0])
	return out
}

// hashFile reads stored hashes from hashes.db: hash i at offset 32*i.
type hashFile struct{ f file }

func (h hashFile) ReadHashes(indexes []int64) ([]tlog.Hash, error) {
	out := make([]tlog.Hash, len(indexes))
	for i, x := range indexes {
		if _, err := h.f.ReadAt(out[i][:], x*tlog.HashSize); err != nil {
			return nil, fmt.Errorf("read hashes.db entry %d: %w", x, err)
		}
	}
	return out, nil
}

// storedCount is tlog.StoredHashCount for a uint64 size.
func storedCount(n uint64) int64 { return tlog.StoredHashCount(int64(n)) }
