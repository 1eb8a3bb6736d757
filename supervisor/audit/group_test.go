package audit

import (
	"context"
	"errors"
	"testing"
)

// TestAppendAllIsOneCommit: records appended together, and the decisions
// a BeginAfter carries before its intent, cost one group commit, in order.
func TestAppendAllIsOneCommit(t *testing.T) {
	l := openLog(t, t.TempDir(), Options{})
	defer l.Close()
	ctx := context.Background()
	appendN(t, l, 2)
	before := l.Commits()
	seqs, err := l.AppendAll(ctx, sample(10), sample(11), sample(12))
	if err != nil || len(seqs) != 3 || seqs[0] != 2 || seqs[2] != 4 {
		t.Fatalf("AppendAll: %v %v", seqs, err)
	}
	if n := l.Commits() - before; n != 1 {
		t.Errorf("%d commits for three records appended together", n)
	}
	before = l.Commits()
	p, err := l.BeginAfter(ctx, []Record{sample(20), sample(21)}, Record{VM: "demo", Provenance: Host, Data: []byte(`{"action":"exec"}`)})
	if err != nil || p.Seq() != 7 {
		t.Fatalf("BeginAfter: %v %v", p, err)
	}
	if n := l.Commits() - before; n != 1 {
		t.Errorf("%d commits for two decisions and an intent", n)
	}
	// An outcome appended with another record is tied to its intent.
	before = l.Commits()
	seqs, err = l.AppendAll(ctx, p.Outcome(Record{Provenance: Host, Data: []byte(`{"code":0}`)}), sample(30))
	if err != nil || l.Commits()-before != 1 {
		t.Fatalf("outcome with a record: %v %v", seqs, err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	rep := mustVerify(t, l.Dir())
	if rep.Records != 10 {
		t.Errorf("%d records", rep.Records)
	}
	// A bad record refuses the whole group.
	l = openLog(t, l.Dir(), Options{})
	defer l.Close()
	bad := sample(40)
	bad.Provenance = "nobody"
	if _, err := l.AppendAll(ctx, sample(41), bad); !errors.Is(err, ErrInvalid) {
		t.Errorf("a group with a bad record: %v", err)
	}
	if n := l.Size(); n != 10 {
		t.Errorf("size %d after a refused group", n)
	}
}
