package audit

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// FuzzRecover: any bytes as records.log. Verify never panics; Open either
// refuses with an error or recovers a log that verifies and that keeps
// every record Scan could read before the first bad frame.
func FuzzRecover(f *testing.F) {
	seed := f.TempDir()
	l := openLog(f, seed, Options{})
	appendN(f, l, 3)
	l.Begin(f.Context(), Record{Provenance: Host})
	l.Close()
	os.RemoveAll(filepath.Join(seed, checkpointDir))
	valid := readFile(f, filepath.Join(seed, recordsFile))
	f.Add(valid)
	f.Add(valid[:len(valid)-7])
	f.Add(append(valid[:100:100], valid[300:]...))
	f.Add([]byte{})
	f.Add([]byte{1, 0, 0, 0, 0, 0, 0, 0, '{'})
	key, pub := readFile(f, filepath.Join(seed, keyFile)), readFile(f, filepath.Join(seed, keyPubFile))

	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 64<<10 {
			return
		}
		dir := t.TempDir()
		writeFile(t, filepath.Join(dir, keyFile), key) // skip key generation
		writeFile(t, filepath.Join(dir, keyPubFile), pub)
		writeFile(t, filepath.Join(dir, recordsFile), data)
		if _, err := Verify(dir, VerifyOptions{}); err != nil {
			t.Fatalf("verify: %v", err)
		}
		var good uint64
		Scan(dir, func(uint64, int64, []byte) error { good++; return nil })

		l, err := Open(dir, Options{Logger: quiet, open: noSyncOpen, writeFile: os.WriteFile}) // speed: no fsync
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("open: %v", err)
			}
			return
		}
		rc := l.Recovered()
		if err := l.Close(); err != nil {
			t.Fatal(err)
		}
		if rc.Records != good {
			t.Fatalf("kept %d records, %d were readable", rc.Records, good)
		}
		mustVerify(t, dir)
	})
}

// noSyncFile skips fdatasync, which a fuzz target does not need.
type noSyncFile struct{ file }

func (noSyncFile) Sync() error { return nil }

func noSyncOpen(name string) (file, error) {
	f, err := openAppend(name)
	return noSyncFile{f}, err
}
