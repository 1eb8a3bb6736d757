// Package audittest does to an audit log what an attacker with the host's
// key could: for tests of what catches it (witnesses, kept checkpoints).
package audittest

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"

	"github.com/carrel-os/carrel/supervisor/audit"
)

// SignCheckpoint signs a checkpoint of size and root with the key of the
// log in dir.
func SignCheckpoint(dir string, size uint64, root tlog.Hash) ([]byte, error) {
	skey, err := os.ReadFile(filepath.Join(dir, "key"))
	if err != nil {
		return nil, err
	}
	s, err := note.NewSigner(strings.TrimSpace(string(skey)))
	if err != nil {
		return nil, err
	}
	return note.Sign(&note.Note{Text: fmt.Sprintf("%s\n%d\n%s\n", s.Name(), size, root)}, s)
}

// RewriteRecord changes record seq of the closed log in dir, in place (a
// letter of its data becomes another, so it still reads as a record, its
// frame's CRC made right), and signs every checkpoint that covers it again
// with the log's key over the new tree, leaving the lines of other signers
// (witnesses) as they were. A verify by the log's key alone then passes.
func RewriteRecord(dir string, seq int) error {
	path := filepath.Join(dir, "records.log")
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var payloads [][]byte
	for off := 0; off+8 <= len(b); {
		n := int(binary.LittleEndian.Uint32(b[off:]))
		if off+8+n > len(b) {
			return fmt.Errorf("a frame at %d runs past the end", off)
		}
		payload := b[off+8 : off+8+n]
		if len(payloads) == seq {
			i := bytes.LastIndexAny(payload, "abcdefghijklmnopqrstuvwxyz")
			if i < 0 {
				return fmt.Errorf("record %d has no letter to change", seq)
			}
			payload[i] = 'a' + (payload[i]-'a'+1)%26
			binary.LittleEndian.PutUint32(b[off+4:], crc32.Checksum(payload, crc32.MakeTable(crc32.Castagnoli)))
		}
		payloads = append(payloads, payload)
		off += 8 + n
	}
	if seq >= len(payloads) {
		return fmt.Errorf("the log has %d records, not %d", len(payloads), seq+1)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		return err
	}
	var stored []tlog.Hash
	hr := tlog.HashReaderFunc(func(idx []int64) ([]tlog.Hash, error) {
		out := make([]tlog.Hash, len(idx))
		for i, x := range idx {
			out[i] = stored[x]
		}
		return out, nil
	})
	for i, p := range payloads {
		hs, err := tlog.StoredHashes(int64(i), p, hr)
		if err != nil {
			return err
		}
		stored = append(stored, hs...)
	}
	origin, err := keyName(dir)
	if err != nil {
		return err
	}
	ents, err := os.ReadDir(filepath.Join(dir, "checkpoints"))
	if err != nil {
		return err
	}
	for _, e := range ents {
		size, err := strconv.ParseUint(e.Name(), 10, 64)
		if err != nil || size <= uint64(seq) {
			continue
		}
		root, err := tlog.TreeHash(int64(size), hr)
		if err != nil {
			return err
		}
		cpath := filepath.Join(dir, "checkpoints", e.Name())
		old, err := os.ReadFile(cpath)
		if err != nil {
			return err
		}
		_, sigs, _ := strings.Cut(string(old), "\n\n")
		var others []string
		for _, line := range strings.SplitAfter(sigs, "\n") {
			if line != "" && !strings.HasPrefix(line, "— "+origin+" ") {
				others = append(others, line)
			}
		}
		signed, err := SignCheckpoint(dir, size, root)
		if err != nil {
			return err
		}
		if err := os.WriteFile(cpath, append(signed, strings.Join(others, "")...), 0o644); err != nil {
			return err
		}
	}
	// hashes.db holds the old tree: a carreld would trust it up to its
	// checkpoint. What the attacker leaves behind is theirs to fix; the
	// offline verify reads records alone.
	return os.Remove(filepath.Join(dir, "hashes.db"))
}

// keyName is the name of the log's key, its origin.
func keyName(dir string) (string, error) {
	vkey, err := audit.PublicKey(dir)
	if err != nil {
		return "", err
	}
	name, _, _ := strings.Cut(vkey, "+")
	return name, nil
}
