package audit

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"

	"github.com/carrel-os/carrel/supervisor/atomicfile"
)

const checkpointDir = "checkpoints"

// Checkpoint is a signed tree head: the log's first Size records hash to
// Root.
type Checkpoint struct {
	Size uint64
	Root tlog.Hash
	Note []byte // the signed note, as stored in checkpoints/
}

// formatCheckpoint is the note text: a C2SP tlog checkpoint of the log
// whose origin (its key's name) is origin.
func formatCheckpoint(origin string, size uint64, root tlog.Hash) string {
	return fmt.Sprintf("%s\n%d\n%s\n", origin, size, root)
}

// parseCheckpointText reads a checkpoint of the log whose origin is
// origin.
func parseCheckpointText(text, origin string) (uint64, tlog.Hash, error) {
	lines := strings.SplitN(text, "\n", 4)
	if len(lines) < 4 || lines[0] != origin {
		return 0, tlog.Hash{}, fmt.Errorf("not a checkpoint of %s", origin)
	}
	size, err := strconv.ParseUint(lines[1], 10, 64)
	if err != nil || lines[1] != strconv.FormatUint(size, 10) {
		return 0, tlog.Hash{}, fmt.Errorf("bad tree size %q", lines[1])
	}
	root, err := tlog.ParseHash(lines[2])
	if err != nil {
		return 0, tlog.Hash{}, fmt.Errorf("bad root hash %q", lines[2])
	}
	return size, root, nil
}

// ParseCheckpoint checks a signed checkpoint against the verifier key and
// returns what it says.
func ParseCheckpoint(msg []byte, verifierKey string) (*Checkpoint, error) {
	v, err := note.NewVerifier(verifierKey)
	if err != nil {
		return nil, fmt.Errorf("verifier key: %w", err)
	}
	return parseCheckpoint(msg, note.VerifierList(v))
}

func parseCheckpoint(msg []byte, vs note.Verifiers) (*Checkpoint, error) {
	n, err := note.Open(msg, vs)
	if err != nil {
		return nil, fmt.Errorf("checkpoint signature: %w", err)
	}
	// The log's origin is its key's name: the signature that verified.
	size, root, err := parseCheckpointText(n.Text, n.Sigs[0].Name)
	if err != nil {
		return nil, err
	}
	return &Checkpoint{Size: size, Root: root, Note: msg}, nil
}

func checkpointName(size uint64) string { return fmt.Sprintf("%020d", size) }

// listCheckpoints returns the sizes of the checkpoint files in dir,
// ascending. Names that are not 20 digits are not checkpoints.
func listCheckpoints(dir string) ([]uint64, error) {
	ents, err := os.ReadDir(filepath.Join(dir, checkpointDir))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list checkpoints: %w", err)
	}
	var sizes []uint64
	for _, e := range ents {
		name := e.Name()
		if len(name) != 20 || !e.Type().IsRegular() {
			continue
		}
		if n, err := strconv.ParseUint(name, 10, 64); err == nil && checkpointName(n) == name {
			sizes = append(sizes, n)
		}
	}
	slices.Sort(sizes)
	return sizes, nil
}

// latestCheckpoint reads and checks the largest checkpoint, or returns
// nil when there is none.
func latestCheckpoint(dir string, vs note.Verifiers) (*Checkpoint, error) {
	sizes, err := listCheckpoints(dir)
	if err != nil || len(sizes) == 0 {
		return nil, err
	}
	size := sizes[len(sizes)-1]
	msg, err := os.ReadFile(filepath.Join(dir, checkpointDir, checkpointName(size)))
	if err != nil {
		return nil, fmt.Errorf("read checkpoint %d: %w", size, err)
	}
	cp, err := parseCheckpoint(msg, vs)
	if err != nil {
		return nil, &CheckpointError{Size: size, Reason: err.Error()}
	}
	if cp.Size != size {
		return nil, &CheckpointError{Size: size, Reason: fmt.Sprintf("file name says %d records, the note %d", size, cp.Size)}
	}
	return cp, nil
}

// checkpointer writes signed checkpoints off the commit path: the
// committer asks for one (after writing the hashes it covers) and goes on.
type checkpointer struct {
	dir       string
	signer    note.Signer
	hashes    file
	writeFile func(string, []byte, os.FileMode) error
	written   func(Checkpoint) // Options.OnCheckpoint
	logger    *slog.Logger
	sincePack int // checkpoints written since the last pack
	// packMu makes packs one at a time: two would append the same
	// checkpoints to the pack at once.
	packMu sync.Mutex

	mu     sync.Mutex
	want   Checkpoint // the latest asked for
	latest *Checkpoint
	kick   chan struct{}
}

// request asks for a checkpoint at size; a later request supersedes one
// not yet written.
func (c *checkpointer) request(size uint64, root tlog.Hash) {
	c.mu.Lock()
	if size > c.want.Size {
		c.want = Checkpoint{Size: size, Root: root}
	}
	c.mu.Unlock()
	select {
	case c.kick <- struct{}{}:
	default:
	}
}

// flush writes the checkpoint asked for, if it is not written yet.
func (c *checkpointer) flush() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	w := c.want
	if w.Size == 0 || c.latest != nil && c.latest.Size >= w.Size {
		return nil
	}
	// The hashes under the checkpoint become durable first: Open trusts
	// hashes.db up to the latest checkpoint it can verify.
	if err := c.hashes.Sync(); err != nil {
		return fmt.Errorf("sync hashes.db: %w", err)
	}
	msg, err := note.Sign(&note.Note{Text: formatCheckpoint(c.signer.Name(), w.Size, w.Root)}, c.signer)
	if err != nil {
		return fmt.Errorf("sign checkpoint %d: %w", w.Size, err)
	}
	path := filepath.Join(c.dir, checkpointDir, checkpointName(w.Size))
	if err := c.writeFile(path, msg, 0o644); err != nil {
		return fmt.Errorf("write checkpoint %d: %w", w.Size, err)
	}
	c.latest = &Checkpoint{Size: w.Size, Root: w.Root, Note: msg}
	if c.written != nil {
		c.written(*c.latest)
	}
	c.sincePack++
	return nil
}

// packIfDue packs older checkpoints once enough were written since the
// last time to be worth it. It runs after flush, without the lock that
// request takes on the commit path. It is housekeeping: a failure leaves
// the files, for the next time.
func (c *checkpointer) packIfDue() {
	c.packMu.Lock()
	defer c.packMu.Unlock()
	c.mu.Lock()
	due := c.sincePack >= packAbove-keepFiles
	c.mu.Unlock()
	if !due {
		return
	}
	packed, err := pack(c.dir)
	if err != nil && c.logger != nil {
		c.logger.Warn("older checkpoints not packed; their files stay", "err", err)
	}
	if packed {
		c.mu.Lock()
		c.sincePack = 0
		c.mu.Unlock()
	}
}

// AddCosignatures adds a witness's signature lines to the checkpoint of
// size in the log in dir: its note then carries the log's signature and
// the cosignatures together. The checkpoint must still open with key (the
// log's), and sigs must be signature lines; the file is replaced
// atomically.
func AddCosignatures(dir string, size uint64, key note.Verifier, sigs []byte) error {
	path := filepath.Join(dir, checkpointDir, checkpointName(size))
	msg, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	n, err := note.Open(msg, note.VerifierList(key))
	if err != nil {
		return fmt.Errorf("checkpoint %d: %w", size, err)
	}
	if !strings.HasSuffix(string(msg), "\n") || len(sigs) == 0 || !strings.HasSuffix(string(sigs), "\n") {
		return fmt.Errorf("checkpoint %d: cosignatures are whole signature lines", size)
	}
	for _, line := range strings.SplitAfter(strings.TrimSuffix(string(sigs), "\n"), "\n") {
		if !strings.HasPrefix(line, "\u2014 ") {
			return fmt.Errorf("checkpoint %d: %.80q is not a signature line", size, line)
		}
	}
	// A signer already there is not added again.
	for _, line := range strings.SplitAfter(strings.TrimSuffix(string(sigs), "\n"), "\n") {
		name, _, _ := strings.Cut(strings.TrimPrefix(line, "\u2014 "), " ")
		if strings.Contains(string(msg), "\n\u2014 "+name+" ") {
			return nil
		}
	}
	out := append(msg[:len(msg):len(msg)], sigs...)
	if _, err := note.Open(out, note.VerifierList(key)); err != nil {
		return fmt.Errorf("checkpoint %d with the cosignatures: %w", size, err)
	}
	_ = n
	return atomicfile.WriteFile(path, out, 0o644)
}

func (c *checkpointer) current() *Checkpoint {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.latest == nil {
		return nil
	}
	cp := *c.latest
	return &cp
}
