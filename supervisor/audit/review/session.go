package review

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/carrel-os/carrel/supervisor/audit"
)

// ErrNotFound means the log holds no record of the session or VM asked
// for.
var ErrNotFound = errors.New("not in the audit log")

// IsSessionID reports whether arg names a session ("ses_…") rather than
// a VM.
func IsSessionID(arg string) bool { return strings.HasPrefix(arg, "ses_") }

// Session is the records of one session: one run of a VM, from start to
// stop.
type Session struct {
	ID string
	VM string
	// Entries are the session's records in seq order: those that name it,
	// and those that name its VM but no session and were written while it
	// ran (between its first and its last record).
	Entries []Entry
	// End is where the scan of records.log stopped: records after it were
	// not written yet when the session was read.
	End audit.ScanEnd
}

// LoadSession reads session id's records from the log. A record still
// being appended is not an error: the session ends at the last complete
// one.
func LoadSession(r *audit.Reader, id string) (*Session, error) {
	s := &Session{ID: id}
	needID := quoted(id)
	var needVM []byte
	// Records of the VM that name no session, after the session's first
	// record; those after its last are dropped at the end.
	var loose []Entry
	end, err := r.Scan(func(seq uint64, off int64, p []byte) error {
		hasID := bytes.Contains(p, needID)
		if !hasID && (needVM == nil || !bytes.Contains(p, needVM)) {
			return nil
		}
		rec, err := decode(seq, p)
		if err != nil {
			return err
		}
		e := Entry{Record: rec, Offset: off, Payload: bytes.Clone(p)}
		switch {
		case rec.Session == id:
			if s.VM == "" {
				s.VM, needVM = rec.VM, quoted(rec.VM)
			}
			s.Entries = append(append(s.Entries, loose...), e)
			loose = loose[:0]
		case rec.Session == "" && s.VM != "" && rec.VM == s.VM:
			loose = append(loose, e)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if len(s.Entries) == 0 {
		return nil, fmt.Errorf("session %s: %w", id, ErrNotFound)
	}
	s.End = end
	return s, nil
}

// ScanVM calls fn for each record that names vm, in seq order.
func ScanVM(r *audit.Reader, vm string, fn func(Entry) error) (audit.ScanEnd, error) {
	need := quoted(vm)
	found := false
	end, err := r.Scan(func(seq uint64, off int64, p []byte) error {
		if !bytes.Contains(p, need) {
			return nil
		}
		rec, err := decode(seq, p)
		if err != nil {
			return err
		}
		if rec.VM != vm {
			return nil
		}
		found = true
		return fn(Entry{Record: rec, Offset: off, Payload: bytes.Clone(p)})
	})
	if err == nil && !found {
		err = fmt.Errorf("vm %q: %w", vm, ErrNotFound)
	}
	return end, err
}

// RecentVM calls fn for the last n records that name vm, oldest first.
// It reads the log back from its end, a window at a time, and no further
// than maxBytes from it, so that its cost does not grow with the log:
// partial says that fewer than n were found there and older ones were
// not looked for.
func RecentVM(r *audit.Reader, vm string, n int, maxBytes int64, fn func(Entry) error) (partial bool, err error) {
	if n <= 0 {
		return false, nil
	}
	size, err := r.Size()
	if err != nil {
		return false, err
	}
	need := quoted(vm)
	window := min(int64(1<<20), maxBytes)
	var offs []int64 // the last n found, oldest first
	for {
		from := max(size-window, 0)
		offs = offs[:0]
		if _, err := r.ScanFrom(from, func(_ uint64, off int64, p []byte) error {
			if !bytes.Contains(p, need) {
				return nil
			}
			rec, err := audit.Decode(p)
			if err != nil {
				return fmt.Errorf("record at offset %d: %w (run carrel audit verify)", off, err)
			}
			if rec.VM == vm {
				if len(offs) == n {
					offs = offs[1:]
				}
				offs = append(offs, off)
			}
			return nil
		}); err != nil {
			return false, err
		}
		if len(offs) == n || from == 0 || window >= maxBytes {
			partial = len(offs) < n && from > 0
			break
		}
		window = min(window*4, maxBytes)
	}
	// Read again only the records returned: a window's records are not
	// all kept in memory.
	for _, off := range offs {
		p, err := r.ReadRecord(off)
		if err != nil {
			return false, err
		}
		rec, err := audit.Decode(p)
		if err != nil {
			return false, fmt.Errorf("record at offset %d: %w (run carrel audit verify)", off, err)
		}
		if err := fn(Entry{Record: rec, Offset: off, Payload: p}); err != nil {
			return false, err
		}
	}
	return partial, nil
}

// decode decodes the record at position seq, which must say so.
func decode(seq uint64, p []byte) (audit.Record, error) {
	rec, err := audit.Decode(p)
	if err != nil {
		return rec, fmt.Errorf("record %d: %w (run carrel audit verify)", seq, err)
	}
	if rec.Seq != seq {
		return rec, fmt.Errorf("record %d says it is record %d: the log is damaged (run carrel audit verify)", seq, rec.Seq)
	}
	return rec, nil
}

// quoted is s as the log writes it in a record: a JSON string. A record
// that names s contains it; one that does not is not decoded.
func quoted(s string) []byte {
	b, _ := json.Marshal(s)
	return b
}
