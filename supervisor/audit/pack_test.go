package audit

import (
	"os"
	"path/filepath"
	"testing"
)

// TestCheckpointsPacked: a log that signs many checkpoints keeps the
// newest as files and packs the rest into one file; every one still
// verifies, a damaged pack is named, and a crash between the pack and the
// files' removal reads each checkpoint once.
func TestCheckpointsPacked(t *testing.T) {
	dir := t.TempDir()
	l := openLog(t, dir, Options{CheckpointEvery: 1})
	for range packAbove + 40 {
		appendN(t, l, 1)
		l.ckpt.flush() // one checkpoint per record, at once
		l.ckpt.packIfDue()
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	files, err := listCheckpoints(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(files) > packAbove || len(files) < keepFiles {
		t.Errorf("%d checkpoint files, want %d to %d", len(files), keepFiles, packAbove)
	}
	packed, err := readPacked(dir)
	if err != nil || len(packed) == 0 {
		t.Fatalf("packed: %d, %v", len(packed), err)
	}
	rep := mustVerify(t, dir)
	if rep.Checkpoints != len(files)+len(packed) || rep.Checkpoints < packAbove {
		t.Errorf("verified %d checkpoints, %d files and %d packed", rep.Checkpoints, len(files), len(packed))
	}
	// The oldest packed one reads back.
	if msg, err := readCheckpoint(dir, packed[0].size); err != nil || string(msg) != string(packed[0].msg) {
		t.Errorf("readCheckpoint(%d): %v", packed[0].size, err)
	}

	// A crash after the pack was written, before the files went: both.
	if err := os.WriteFile(filepath.Join(dir, checkpointDir, checkpointName(packed[0].size)), packed[0].msg, 0o644); err != nil {
		t.Fatal(err)
	}
	if rep := mustVerify(t, dir); rep.Checkpoints != len(files)+len(packed) {
		t.Errorf("with a checkpoint both packed and in its file: %d checkpoints", rep.Checkpoints)
	}

	// A damaged pack is an error that names it.
	p := filepath.Join(dir, checkpointDir, packFile)
	b := readFile(t, p)
	writeFile(t, p, b[:len(b)-10])
	if _, err := Verify(dir, VerifyOptions{}); err == nil {
		t.Error("Verify took a cut pack")
	}
}
