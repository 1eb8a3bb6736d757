package audit

import (
	"errors"
	"fmt"
	"io"
)

// Scan calls fn for each record of the log in dir, in order, with its
// seq (its index), its byte offset and its payload, which is valid only
// during the call (Decode it, or copy it). It reads the segments the
// directory holds, from the first (Reader.First). It stops at the first
// frame that cannot be read and returns an error saying where; Verify
// says more.
func Scan(dir string, fn func(seq uint64, offset int64, payload []byte) error) error {
	r, err := OpenReader(dir)
	if err != nil {
		return fmt.Errorf("scan audit log: %w", err)
	}
	defer r.Close()
	size, err := r.Size()
	if err != nil {
		return fmt.Errorf("scan audit log: %w", err)
	}
	fr := newFrameReader(r.src, size)
	fr.seek(r.start)
	for seq := r.first; ; seq++ {
		p, off, err := fr.next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("scan audit log %s: record %d: %w", dir, seq, err)
		}
		if err := fn(seq, off, p); err != nil {
			return err
		}
	}
}
