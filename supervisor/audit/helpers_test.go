package audit

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
)

var quiet = slog.New(slog.DiscardHandler)

func openLog(t testing.TB, dir string, opts Options) *Log {
	t.Helper()
	if opts.Logger == nil {
		opts.Logger = quiet
	}
	l, err := Open(dir, opts)
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	return l
}

// sample is a typical record, about 300 bytes serialized.
func sample(i int) Record {
	return Record{
		Kind: KindExecStart, VM: "demo", Session: "s-0123456789abcdef", Provenance: Host,
		Data: json.RawMessage(fmt.Sprintf(`{"argv":["go","test","./..."],"cwd":"/workspace/src","env":{"HOME":"/workspace","GOFLAGS":"-mod=mod"},"user":"agent","n":%d}`, i)),
	}
}

func appendN(t testing.TB, l *Log, n int) []uint64 {
	t.Helper()
	seqs := make([]uint64, n)
	for i := range n {
		s, err := l.Append(context.Background(), sample(i))
		if err != nil {
			t.Fatalf("append %d: %v", i, err)
		}
		seqs[i] = s
	}
	return seqs
}

func mustVerify(t testing.TB, dir string) *Report {
	t.Helper()
	rep, err := Verify(dir, VerifyOptions{})
	if err != nil {
		t.Fatalf("verify: %v", err)
	}
	if !rep.OK() {
		for _, p := range rep.Problems {
			t.Errorf("verify: %v", p)
		}
		t.FailNow()
	}
	return rep
}

// frames returns the byte offsets of records.log's frames, and its size.
func frames(t testing.TB, dir string) ([]int64, int64) {
	t.Helper()
	f, err := os.Open(filepath.Join(dir, recordsFile))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, _ := f.Stat()
	fr := newFrameReader(f, st.Size())
	var offs []int64
	for {
		_, off, err := fr.next()
		if err != nil {
			return offs, st.Size()
		}
		offs = append(offs, off)
	}
}

func readFile(t testing.TB, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func writeFile(t testing.TB, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

func errorsAs(err error, target any) bool { return errors.As(err, target) }
func errorsIs(err, target error) bool     { return errors.Is(err, target) }
