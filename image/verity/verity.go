// Package verity builds and checks Linux dm-verity hash trees in pure Go, so
// that carrel can make and re-check verified root images without cryptsetup.
//
// Format writes the same bytes as `veritysetup format` (cryptsetup 2.6.1,
// hash format version 1, sha256) writes to a hash device: one hash block
// holding the superblock, then the tree, top level first. Its root hash is the
// one veritysetup prints, and Table turns it into the parameters of the
// kernel's "verity" device-mapper target. Verify recomputes a tree and
// reports exactly where a hash device or root hash disagrees with the data.
//
// The tree is held in memory while it is built (about 1/127 of the data size
// with 4096-byte blocks); the data itself is streamed.
package verity

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"math/bits"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
)

// Limits that Params must respect.
const (
	MinBlockSize = 512
	MaxBlockSize = 65536
	MaxSaltSize  = 256
)

var (
	// ErrInvalid wraps every rejection of Params or of a malformed superblock.
	ErrInvalid = errors.New("invalid dm-verity parameters")
	// ErrMismatch wraps every disagreement Verify finds between the data,
	// the hash device and the expected root hash.
	ErrMismatch = errors.New("dm-verity mismatch")
)

// Params are the dm-verity parameters an image's manifest records.
type Params struct {
	HashAlg       string   // only "sha256"
	DataBlockSize uint32   // a power of two in [512, 65536]; usually 4096
	HashBlockSize uint32   // a power of two in [512, 65536]; usually 4096
	DataBlocks    uint64   // data size / DataBlockSize; at least 1
	Salt          []byte   // 0 to 256 bytes, hashed before every block
	UUID          [16]byte // recorded in the superblock only
}

// digestSize is sha256's; it divides every allowed hash block size, so a
// hash block holds exactly HashBlockSize/digestSize digests with no slack.
const digestSize = sha256.Size

// levelBlocks returns how many hash blocks each tree level has, level 0 (the
// one hashing the data) first. It is empty for a single data block, whose
// own hash is then the root hash. The rule is the kernel's
// (drivers/md/dm-verity-target.c): add levels until one block covers all data.
func (p Params) levelBlocks() []uint64 {
	shift := uint(bits.TrailingZeros32(p.HashBlockSize / digestSize))
	var levels []uint64
	for l := uint(1); (p.DataBlocks-1)>>(shift*(l-1)) != 0; l++ {
		// ceil(DataBlocks / perBlock^l), without overflowing.
		n := p.DataBlocks >> (shift * l)
		if p.DataBlocks&(1<<(shift*l)-1) != 0 {
			n++
		}
		levels = append(levels, n)
	}
	return levels
}

// HashSize returns how many bytes Format writes for p: the superblock block
// plus the tree. It returns -1 if p is invalid.
func HashSize(p Params) int64 {
	if p.Validate() != nil {
		return -1
	}
	blocks := uint64(1)
	for _, n := range p.levelBlocks() {
		blocks += n
	}
	return int64(blocks * uint64(p.HashBlockSize))
}

// tree is a computed hash tree: levels[0] hashes the data, the last level is
// one block, and root is the hash of that block (or of the only data block).
type tree struct {
	levels [][]byte
	root   []byte
}

// buildTree hashes the data and every level above it. data must hold
// exactly p.DataBlocks blocks; p must be valid.
func buildTree(data io.ReaderAt, p Params) (*tree, error) {
	var t tree
	src, srcBlocks, srcBlockSize := data, p.DataBlocks, int(p.DataBlockSize)
	for _, n := range p.levelBlocks() {
		level := make([]byte, n*uint64(p.HashBlockSize))
		if err := hashBlocks(src, srcBlocks, srcBlockSize, p.Salt, level); err != nil {
			return nil, fmt.Errorf("hash data: %w", err) // only data reads can fail
		}
		t.levels = append(t.levels, level)
		src, srcBlocks, srcBlockSize = bytes.NewReader(level), n, int(p.HashBlockSize)
	}
	t.root = make([]byte, digestSize)
	if err := hashBlocks(src, srcBlocks, srcBlockSize, p.Salt, t.root); err != nil {
		return nil, fmt.Errorf("hash data: %w", err)
	}
	return &t, nil
}

// chunkSize is how much of the source one worker reads and hashes at a time.
const chunkSize = 1 << 20

// hashBlocks writes H(salt || block i) for each of the n blocks of src to
// out[i*digestSize:], using up to GOMAXPROCS goroutines; src must allow
// parallel ReadAt calls, as io.ReaderAt promises.
func hashBlocks(src io.ReaderAt, n uint64, blockSize int, salt []byte, out []byte) error {
	perChunk := uint64(max(1, chunkSize/blockSize))
	chunks := (n + perChunk - 1) / perChunk
	workers := uint64(runtime.GOMAXPROCS(0))
	workers = min(workers, chunks)

	var (
		next     atomic.Uint64
		failed   atomic.Bool
		errOnce  sync.Once
		firstErr error
		wg       sync.WaitGroup
	)
	for range workers {
		wg.Go(func() {
			h := sha256.New()
			buf := make([]byte, perChunk*uint64(blockSize))
			for !failed.Load() {
				c := next.Add(1) - 1
				if c >= chunks {
					return
				}
				first := c * perChunk
				count := min(perChunk, n-first)
				if err := hashChunk(h, src, first, count, blockSize, salt, buf, out); err != nil {
					errOnce.Do(func() { firstErr = err })
					failed.Store(true)
					return
				}
			}
		})
	}
	wg.Wait()
	return firstErr
}

func hashChunk(h hash.Hash, src io.ReaderAt, first, count uint64, blockSize int, salt, buf, out []byte) error {
	buf = buf[:count*uint64(blockSize)]
	off := int64(first) * int64(blockSize)
	if n, err := src.ReadAt(buf, off); n < len(buf) {
		if err == nil || err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return fmt.Errorf("read block %d: %w", first+uint64(n/blockSize), err)
	}
	for i := range count {
		h.Reset()
		h.Write(salt)
		h.Write(buf[i*uint64(blockSize) : (i+1)*uint64(blockSize)])
		d := (first + i) * digestSize
		h.Sum(out[d:d])
	}
	return nil
}

// Format reads the data (size bytes, a whole number of p.DataBlockSize blocks
// matching p.DataBlocks) and writes the hash device contents to w: one
// p.HashBlockSize block holding the version-1 superblock, zero padded, then
// the tree, top level first and level 0 last, exactly as veritysetup lays
// it out. It writes HashSize(p) bytes and returns the root hash. Invalid
// Params or a size that does not match them give an error wrapping
// ErrInvalid. Data is read in parallel, as io.ReaderAt allows.
func Format(data io.ReaderAt, size int64, p Params, w io.Writer) (rootHash []byte, err error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	if err := checkDataSize(size, p); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	t, err := buildTree(data, p)
	if err != nil {
		return nil, err
	}
	sb := make([]byte, p.HashBlockSize)
	copy(sb, p.marshalSuperblock())
	if _, err := w.Write(sb); err != nil {
		return nil, fmt.Errorf("write verity superblock: %w", err)
	}
	for i := len(t.levels) - 1; i >= 0; i-- {
		if _, err := w.Write(t.levels[i]); err != nil {
			return nil, fmt.Errorf("write verity tree level %d: %w", i, err)
		}
	}
	return t.root, nil
}

func checkDataSize(size int64, p Params) error {
	if size <= 0 || size%int64(p.DataBlockSize) != 0 {
		return fmt.Errorf("data size %d is not a whole, non-zero number of %d-byte blocks", size, p.DataBlockSize)
	}
	if got := uint64(size) / uint64(p.DataBlockSize); got != p.DataBlocks {
		return fmt.Errorf("data holds %d blocks, parameters say %d", got, p.DataBlocks)
	}
	return nil
}

// maxReported bounds how many differing blocks Verify names per level.
const maxReported = 3

// Verify recomputes the tree from data and checks that the hash device
// (hashSize bytes, exactly HashSize(p)) holds exactly what Format would write
// for p, superblock and padding included, and that the root hash equals
// want. Invalid Params give an error wrapping ErrInvalid. Every disagreement
// gives one error wrapping ErrMismatch that names what differs, such as
// "hash block 17 of level 0 differs" or "root hash is X, manifest says Y";
// read failures are returned as they are.
func Verify(data io.ReaderAt, dataSize int64, hash io.ReaderAt, hashSize int64, p Params, want []byte) error {
	if err := p.Validate(); err != nil {
		return err
	}
	if err := checkDataSize(dataSize, p); err != nil {
		return fmt.Errorf("%w: %w", ErrMismatch, err)
	}
	if wantSize := HashSize(p); hashSize != wantSize {
		return fmt.Errorf("%w: hash device is %d bytes, parameters need %d", ErrMismatch, hashSize, wantSize)
	}

	var diffs []string
	sb, err := readFull(hash, 0, int(p.HashBlockSize))
	if err != nil {
		return fmt.Errorf("read verity superblock: %w", err)
	}
	diffs = append(diffs, superblockDiffs(sb, p)...)

	t, err := buildTree(data, p)
	if err != nil {
		return err
	}
	// Level offsets on the device: the superblock block, then top level down.
	offsets := make([]int64, len(t.levels))
	off := int64(p.HashBlockSize)
	for i := len(t.levels) - 1; i >= 0; i-- {
		offsets[i] = off
		off += int64(len(t.levels[i]))
	}
	for i, level := range t.levels {
		d, err := levelDiffs(hash, offsets[i], level, i, int(p.HashBlockSize))
		if err != nil {
			return err
		}
		diffs = append(diffs, d...)
	}
	if !bytes.Equal(t.root, want) {
		diffs = append(diffs, fmt.Sprintf("root hash is %x, manifest says %x", t.root, want))
	}
	if len(diffs) > 0 {
		return fmt.Errorf("%w: %s", ErrMismatch, strings.Join(diffs, "; "))
	}
	return nil
}

// superblockDiffs names how the superblock block sb differs from the one
// Format writes for p.
func superblockDiffs(sb []byte, p Params) []string {
	want := make([]byte, p.HashBlockSize)
	copy(want, p.marshalSuperblock())
	if bytes.Equal(sb, want) {
		return nil
	}
	got, err := parseSuperblock(sb)
	if err != nil {
		return []string{"superblock: " + err.Error()}
	}
	var diffs []string
	field := func(name string, got, want any) {
		if fmt.Sprint(got) != fmt.Sprint(want) {
			diffs = append(diffs, fmt.Sprintf("superblock %s is %v, manifest says %v", name, got, want))
		}
	}
	field("hash algorithm", got.HashAlg, p.HashAlg)
	field("data block size", got.DataBlockSize, p.DataBlockSize)
	field("hash block size", got.HashBlockSize, p.HashBlockSize)
	field("data blocks", got.DataBlocks, p.DataBlocks)
	field("salt", hexOrDash(got.Salt), hexOrDash(p.Salt))
	field("uuid", hex.EncodeToString(got.UUID[:]), hex.EncodeToString(p.UUID[:]))
	if len(diffs) == 0 {
		for i := range sb {
			if sb[i] != want[i] {
				diffs = append(diffs, fmt.Sprintf("superblock block differs at byte %d (padding)", i))
				break
			}
		}
	}
	return diffs
}

// levelDiffs compares one computed level with the device bytes at off.
func levelDiffs(dev io.ReaderAt, off int64, level []byte, index, blockSize int) ([]string, error) {
	var bad []int
	count := 0
	step := max(blockSize, chunkSize/blockSize*blockSize)
	for start := 0; start < len(level); start += step {
		want := level[start:min(start+step, len(level))]
		got, err := readFull(dev, off+int64(start), len(want))
		if err != nil {
			return nil, fmt.Errorf("read verity tree level %d: %w", index, err)
		}
		for b := 0; b < len(want); b += blockSize {
			if !bytes.Equal(got[b:b+blockSize], want[b:b+blockSize]) {
				if count < maxReported {
					bad = append(bad, (start+b)/blockSize)
				}
				count++
			}
		}
	}
	var diffs []string
	for _, b := range bad {
		diffs = append(diffs, fmt.Sprintf("hash block %d of level %d differs", b, index))
	}
	if count > len(bad) {
		diffs = append(diffs, fmt.Sprintf("%d more hash blocks of level %d differ", count-len(bad), index))
	}
	return diffs, nil
}

func readFull(r io.ReaderAt, off int64, n int) ([]byte, error) {
	b := make([]byte, n)
	got, err := r.ReadAt(b, off)
	if got < n {
		if err == nil || err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, fmt.Errorf("at offset %d: %w", off+int64(got), err)
	}
	return b, nil
}

// Table returns the parameters of the kernel's device-mapper "verity" target
// for data on dataDev and the hash device from Format on hashDev (paths such
// as "/dev/vda" or major:minor such as "253:0"):
//
//	1 <data_dev> <hash_dev> <data_block_size> <hash_block_size> <data_blocks> 1 sha256 <root hash hex> <salt hex or ->
//
// The hash start block is 1 because the tree follows the superblock block.
func Table(dataDev, hashDev string, p Params, rootHash []byte) string {
	return fmt.Sprintf("1 %s %s %d %d %d 1 %s %x %s",
		dataDev, hashDev, p.DataBlockSize, p.HashBlockSize, p.DataBlocks, p.HashAlg, rootHash, hexOrDash(p.Salt))
}

func hexOrDash(b []byte) string {
	if len(b) == 0 {
		return "-"
	}
	return hex.EncodeToString(b)
}
