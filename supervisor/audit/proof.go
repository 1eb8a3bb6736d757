package audit

import (
	"fmt"

	"golang.org/x/mod/sumdb/tlog"
)

// hashedSize checks that the log holds n records, and waits until they
// are hashed: the committer hashes a batch right after waking its
// appenders.
func (l *Log) hashedSize(n uint64) error {
	if size := l.size.Load(); n > size {
		return fmt.Errorf("tree size %d: the log holds %d records", n, size)
	}
	l.hashMu.Lock()
	for l.hashed.Load() < n {
		l.hashCond.Wait()
	}
	l.hashMu.Unlock()
	return nil
}

// TreeHash is the root of the tree over the first size records.
func (l *Log) TreeHash(size uint64) (tlog.Hash, error) {
	if err := l.hashedSize(size); err != nil {
		return tlog.Hash{}, err
	}
	return tlog.TreeHash(int64(size), l.hashReader())
}

// Proof proves that record seq is in the tree of size treeSize (an RFC
// 6962 audit path); check it with CheckProof against that tree's root,
// e.g. a checkpoint's.
func (l *Log) Proof(seq, treeSize uint64) (tlog.RecordProof, error) {
	if err := l.hashedSize(treeSize); err != nil {
		return nil, err
	}
	if seq >= treeSize {
		return nil, fmt.Errorf("record %d is not in a tree of %d", seq, treeSize)
	}
	return tlog.ProveRecord(int64(treeSize), int64(seq), l.hashReader())
}

// ConsistencyProof proves that the tree of size old is a prefix of the
// tree of size treeSize; check it with tlog.CheckTree.
func (l *Log) ConsistencyProof(old, treeSize uint64) (tlog.TreeProof, error) {
	if err := l.hashedSize(treeSize); err != nil {
		return nil, err
	}
	if old == 0 || old > treeSize {
		return nil, fmt.Errorf("tree %d cannot be a prefix of tree %d", old, treeSize)
	}
	return tlog.ProveTree(int64(treeSize), int64(old), l.hashReader())
}

// CheckProof checks that payload, the bytes of record seq in records.log,
// is in the tree of size treeSize whose root is root.
func CheckProof(p tlog.RecordProof, treeSize uint64, root tlog.Hash, seq uint64, payload []byte) error {
	return tlog.CheckRecord(p, int64(treeSize), root, int64(seq), tlog.RecordHash(payload))
}

// hashReader reads stored hashes from hashes.db and, for those not yet
// written there, from memory.
func (l *Log) hashReader() tlog.HashReader {
	return tlog.HashReaderFunc(func(indexes []int64) ([]tlog.Hash, error) {
		l.hashMu.Lock()
		defer l.hashMu.Unlock()
		out := make([]tlog.Hash, len(indexes))
		for i, x := range indexes {
			if x < l.hashN {
				if _, err := l.hash.ReadAt(out[i][:], x*tlog.HashSize); err != nil {
					return nil, fmt.Errorf("read hashes.db entry %d: %w", x, err)
				}
				continue
			}
			j := (x - l.hashN) * tlog.HashSize
			if j+tlog.HashSize > int64(len(l.hashBuf)) {
				return nil, fmt.Errorf("stored hash %d is not there yet", x)
			}
			copy(out[i][:], l.hashBuf[j:])
		}
		return out, nil
	})
}
