package audit

import (
	"errors"

	"golang.org/x/mod/sumdb/note"
)

// Cosigners sorts witnesses by their cosignatures on one checkpoint.
type Cosigners struct {
	// Valid: the witnesses whose cosignature of the checkpoint verifies.
	Valid []string
	// Invalid: those whose cosignature is on it but does not verify: they
	// cosigned another checkpoint (this one was rewritten and signed again,
	// or given another's cosignature).
	Invalid []string
	// Missing: those with no cosignature on it.
	Missing []string
}

// CheckCosignatures checks the cosignatures of witnesses (witness.Verifier)
// on checkpoint msg, which host signed. It returns an error when msg is
// not a note host's signature verifies, or a witness's key is ambiguous
// with another's.
func CheckCosignatures(msg []byte, host note.Verifier, witnesses []note.Verifier) (Cosigners, error) {
	var c Cosigners
	for _, w := range witnesses {
		n, err := note.Open(msg, note.VerifierList(host, w))
		var bad *note.InvalidSignatureError
		switch {
		case errors.As(err, &bad) && bad.Name == w.Name() && bad.Hash == w.KeyHash():
			c.Invalid = append(c.Invalid, w.Name())
		case err != nil:
			return Cosigners{}, err
		case signedBy(n, w):
			c.Valid = append(c.Valid, w.Name())
		default:
			c.Missing = append(c.Missing, w.Name())
		}
	}
	return c, nil
}

func signedBy(n *note.Note, v note.Verifier) bool {
	for _, s := range n.Sigs {
		if s.Name == v.Name() && s.Hash == v.KeyHash() {
			return true
		}
	}
	return false
}
