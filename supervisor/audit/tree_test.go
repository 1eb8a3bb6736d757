package audit

import (
	"fmt"
	"testing"

	"golang.org/x/mod/sumdb/tlog"
)

// The compact range yields tlog's stored hashes and tree hashes.
func TestTreeMatchesTlog(t *testing.T) {
	var stored []tlog.Hash
	reader := tlog.HashReaderFunc(func(idx []int64) ([]tlog.Hash, error) {
		out := make([]tlog.Hash, len(idx))
		for i, x := range idx {
			out[i] = stored[x]
		}
		return out, nil
	})
	tr := &tree{}
	lh := newLeafHasher()
	for n := range int64(300) {
		data := fmt.Appendf(nil, "record %d", n)
		want, err := tlog.StoredHashes(n, data, reader)
		if err != nil {
			t.Fatal(err)
		}
		if lh.sum(data) != tlog.RecordHash(data) {
			t.Fatal("leaf hash differs from tlog.RecordHash")
		}
		got := tr.push(lh.sum(data), nil)
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("record %d: stored hashes %v, tlog %v", n, got, want)
		}
		stored = append(stored, want...)
		root, err := tlog.TreeHash(n+1, reader)
		if err != nil {
			t.Fatal(err)
		}
		if tr.root() != root {
			t.Fatalf("size %d: root %v, tlog %v", n+1, tr.root(), root)
		}
		loaded, err := loadTree(uint64(n+1), reader)
		if err != nil || loaded.root() != root {
			t.Fatalf("size %d: loaded tree root %v (%v)", n+1, loaded.root(), err)
		}
	}
	empty, _ := tlog.TreeHash(0, reader)
	if (&tree{}).root() != empty {
		t.Error("empty tree root")
	}
}
