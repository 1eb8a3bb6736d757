package audit

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/carrel-os/carrel/supervisor/atomicfile"
)

// Checkpoints are written a file each, and the older ones packed into one
// file, so that a long-lived log does not cost a file per checkpoint:
// once more than packAbove files are there, all but the newest keepFiles
// are appended to checkpoints/packed (synced) and their files removed.
// Each entry of the pack is a line "SIZE LENGTH" (the tree size, 20
// digits, and the note's length in bytes), then the note's bytes, as its
// file held them (with any cosignatures).
const (
	packFile  = "packed"
	packAbove = 256
	keepFiles = 64
	// maxPackedNote bounds one packed note, as a reader takes it.
	maxPackedNote = 64 << 10
)

// storedCheckpoint is a checkpoint as stored: its size, its bytes and
// where (a file's name, or the pack's).
type storedCheckpoint struct {
	size uint64
	msg  []byte
	name string
}

// readPacked reads the pack of the log in dir; none is no entries.
func readPacked(dir string) ([]storedCheckpoint, error) {
	f, err := os.Open(filepath.Join(dir, checkpointDir, packFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	br := bufio.NewReader(f)
	var out []storedCheckpoint
	for i := 0; ; i++ {
		line, err := br.ReadString('\n')
		if errors.Is(err, io.EOF) && line == "" {
			return out, nil
		}
		name := fmt.Sprintf("%s/%s#%d", checkpointDir, packFile, i)
		if err != nil {
			return nil, fmt.Errorf("%s: a cut entry", name)
		}
		sizeText, lenText, ok := strings.Cut(strings.TrimSuffix(line, "\n"), " ")
		size, err1 := strconv.ParseUint(sizeText, 10, 64)
		n, err2 := strconv.Atoi(lenText)
		if !ok || err1 != nil || err2 != nil || checkpointName(size) != sizeText || n <= 0 || n > maxPackedNote {
			return nil, fmt.Errorf("%s: a malformed entry header %.60q", name, line)
		}
		msg := make([]byte, n)
		if _, err := io.ReadFull(br, msg); err != nil {
			return nil, fmt.Errorf("%s: a cut entry", name)
		}
		out = append(out, storedCheckpoint{size: size, msg: msg, name: name})
	}
}

// storedCheckpoints returns every checkpoint of the log in dir, packed and
// in files, by size.
func storedCheckpoints(dir string) ([]storedCheckpoint, error) {
	out, err := readPacked(dir)
	if err != nil {
		return nil, err
	}
	sizes, err := listCheckpoints(dir)
	if err != nil {
		return nil, err
	}
	for _, size := range sizes {
		name := filepath.Join(checkpointDir, checkpointName(size))
		msg, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			return nil, err
		}
		out = append(out, storedCheckpoint{size: size, msg: msg, name: name})
	}
	slices.SortStableFunc(out, func(a, b storedCheckpoint) int {
		switch {
		case a.size < b.size:
			return -1
		case a.size > b.size:
			return 1
		}
		return 0
	})
	return out, nil
}

// readCheckpoint returns the stored checkpoint of size.
func readCheckpoint(dir string, size uint64) ([]byte, error) {
	msg, err := os.ReadFile(filepath.Join(dir, checkpointDir, checkpointName(size)))
	if !errors.Is(err, fs.ErrNotExist) {
		return msg, err
	}
	packed, perr := readPacked(dir)
	if perr != nil {
		return nil, perr
	}
	for _, p := range packed {
		if p.size == size {
			return p.msg, nil
		}
	}
	return nil, err
}

// pack moves all but the newest keepFiles checkpoint files into the pack,
// once there are more than packAbove, and says whether it did. The entries are synced before the
// files go: a crash in between leaves a checkpoint in both, which readers
// take once.
func pack(dir string) (bool, error) {
	sizes, err := listCheckpoints(dir)
	if err != nil || len(sizes) <= packAbove {
		return false, err
	}
	old := sizes[:len(sizes)-keepFiles]
	already, err := readPacked(dir)
	if err != nil {
		return false, fmt.Errorf("pack checkpoints: %w", err)
	}
	have := map[uint64]bool{}
	for _, p := range already {
		have[p.size] = true
	}
	f, err := os.OpenFile(filepath.Join(dir, checkpointDir, packFile), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return false, err
	}
	bw := bufio.NewWriter(f)
	for _, size := range old {
		if have[size] {
			continue
		}
		msg, err := os.ReadFile(filepath.Join(dir, checkpointDir, checkpointName(size)))
		if err != nil {
			f.Close()
			return false, err
		}
		fmt.Fprintf(bw, "%s %d\n", checkpointName(size), len(msg))
		bw.Write(msg)
	}
	if err := bw.Flush(); err != nil {
		f.Close()
		return false, err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return false, err
	}
	if err := f.Close(); err != nil {
		return false, err
	}
	for _, size := range old {
		if err := os.Remove(filepath.Join(dir, checkpointDir, checkpointName(size))); err != nil {
			return false, err
		}
	}
	return true, atomicfile.SyncDir(filepath.Join(dir, checkpointDir))
}
