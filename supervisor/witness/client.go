package witness

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"
)

// Caps on a witness's answer.
const (
	maxResponseBytes = 16 << 10
	// CallTimeout bounds one add-checkpoint call.
	CallTimeout = 10 * time.Second
)

// ConflictError is a witness's 409: it last cosigned a tree of Size, not
// the one the request was proved from.
type ConflictError struct{ Size uint64 }

func (e *ConflictError) Error() string {
	return fmt.Sprintf("the witness last cosigned a tree of %d records", e.Size)
}

// RefusedError is a witness's refusal of the checkpoint itself: a tree
// that does not extend what it saw (a rewritten or forked log), a
// signature it does not accept, a log it does not know.
type RefusedError struct {
	Status int
	Reason string
}

func (e *RefusedError) Error() string {
	return fmt.Sprintf("the witness refused the checkpoint (%d): %s", e.Status, e.Reason)
}

// Client asks one witness to cosign.
type Client struct {
	// URL is the witness's base URL; add-checkpoint is below it.
	URL string
	// Key is the witness's verifier key: an answer that is not its valid
	// cosignature of the checkpoint is an error.
	Key *Verifier
	// HTTP defaults to a client with CallTimeout.
	HTTP *http.Client
}

// AddCheckpoint shows the witness the signed checkpoint, with the proof
// that its tree extends the tree of size old that the witness cosigned
// last (none when old is 0), and returns the witness's signature line.
func (c *Client) AddCheckpoint(ctx context.Context, old uint64, proof tlog.TreeProof, checkpoint []byte) ([]byte, error) {
	var b bytes.Buffer
	fmt.Fprintf(&b, "old %d\n", old)
	for _, h := range proof {
		fmt.Fprintf(&b, "%s\n", h)
	}
	b.WriteString("\n")
	b.Write(checkpoint)
	ctx, cancel := context.WithTimeout(ctx, CallTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, "POST", strings.TrimSuffix(c.URL, "/")+"/add-checkpoint", &b)
	if err != nil {
		return nil, err
	}
	hc := c.HTTP
	if hc == nil {
		hc = &http.Client{Timeout: CallTimeout}
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxResponseBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read the witness's answer: %w", err)
	}
	if len(body) > maxResponseBytes {
		return nil, fmt.Errorf("the witness answered over %d bytes", maxResponseBytes)
	}
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusConflict:
		n, err := strconv.ParseUint(strings.TrimSpace(string(body)), 10, 64)
		if err != nil {
			return nil, fmt.Errorf("the witness answered 409 without a tree size: %.100q", body)
		}
		return nil, &ConflictError{Size: n}
	case http.StatusForbidden, http.StatusNotFound, http.StatusUnprocessableEntity, http.StatusBadRequest:
		return nil, &RefusedError{Status: resp.StatusCode, Reason: clean(string(body))}
	default:
		return nil, fmt.Errorf("the witness answered %d: %s", resp.StatusCode, clean(string(body)))
	}
	// The answer must be the witness's valid cosignature of this
	// checkpoint: anything else is garbage, however well-formed.
	n, err := note.Open(checkpoint, acceptAny{})
	var unverified *note.UnverifiedNoteError
	if errors.As(err, &unverified) {
		n, err = unverified.Note, nil
	}
	if err != nil {
		return nil, fmt.Errorf("the checkpoint: %w", err)
	}
	// Exactly one line, the witness's own: a witness may not speak for
	// others (a false line under another's name would read as tampering).
	line := string(body)
	if strings.Count(line, "\n") != 1 || !strings.HasSuffix(line, "\n") || !strings.HasPrefix(line, "\u2014 "+c.Key.Name()+" ") {
		return nil, fmt.Errorf("the witness's answer is not one signature line of its own: %.100q", clean(line))
	}
	signed, err := note.Open(append([]byte(n.Text+"\n"), body...), note.VerifierList(c.Key))
	if err != nil || len(signed.Sigs) != 1 || len(signed.UnverifiedSigs) != 0 {
		return nil, fmt.Errorf("the witness's answer is not its cosignature of the checkpoint: %v", err)
	}
	return body, nil
}

// acceptAny knows no key: opening a note with it only parses it.
type acceptAny struct{}

func (acceptAny) Verifier(name string, hash uint32) (note.Verifier, error) {
	return nil, &note.UnknownVerifierError{Name: name, KeyHash: hash}
}

// clean makes a witness's words safe to log: printable, one line, short.
func clean(s string) string {
	s = strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f {
			return ' '
		}
		return r
	}, s)
	s = strings.TrimSpace(s)
	if len(s) > 256 {
		s = s[:256] + "..."
	}
	return s
}
