package main

import (
	"fmt"
	"io"

	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/audit/review"
)

// openAuditSession opens the log in dir read-only and reads a session's
// records. The caller closes the reader.
func openAuditSession(dir, id string, stderr io.Writer) (*audit.Reader, *review.Session, error) {
	if !review.IsSessionID(id) {
		return nil, nil, fmt.Errorf("%q is not a session (sessions are named ses_ and 16 hex digits; carrel vm ls shows them)", id)
	}
	r, err := audit.OpenReader(dir)
	if err != nil {
		return nil, nil, err
	}
	noteArchived(stderr, r)
	s, err := review.LoadSession(r, id)
	if err != nil {
		r.Close()
		return nil, nil, err
	}
	noteTail(stderr, s.End)
	return r, s, nil
}

// noteArchived says when the log's oldest records are archived, and so
// not read.
func noteArchived(w io.Writer, r *audit.Reader) {
	if r.First() > 0 {
		fmt.Fprintf(w, "note: records before %d are archived (carrel audit verify lists where), and not read here\n", r.First())
	}
}

// noteTail says when records.log ended in a record not yet whole.
func noteTail(w io.Writer, end audit.ScanEnd) {
	if end.TailBytes > 0 {
		fmt.Fprintf(w, "note: records.log ends in %d bytes that are not a whole record yet (carreld appending, or a crash it will cut): read up to record %d\n",
			end.TailBytes, int64(end.Records)-1)
	}
}
