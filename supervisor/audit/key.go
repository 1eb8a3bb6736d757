package audit

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/mod/sumdb/note"

	"github.com/carrel-os/carrel/supervisor/atomicfile"
)

// KeyName is the default name of a log's signing key, and so of its
// origin: the first line of its checkpoints, which is how witnesses tell
// logs apart. Options.Origin names a new log's key otherwise.
const KeyName = "carrel-audit"

const (
	keyFile    = "key"
	keyPubFile = "key.pub"
)

// loadKey reads the log's signing key, generating it (and key.pub) on
// first use. key.pub must match key.
func loadKey(dir, origin string) (note.Signer, string, error) {
	path := filepath.Join(dir, keyFile)
	raw, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		// A lost key must not be replaced silently: key.pub is what
		// reviewers hold checkpoints against.
		if _, err := os.Stat(filepath.Join(dir, keyPubFile)); err == nil {
			return nil, "", fmt.Errorf("audit key %s is missing but %s exists", path, keyPubFile)
		}
		skey, _, err := note.GenerateKey(rand.Reader, origin)
		if err != nil {
			return nil, "", fmt.Errorf("generate audit key: %w", err)
		}
		// key.pub follows below; a crash in between leaves a key whose
		// public half is derived again on the next start.
		if err := atomicfile.WriteFile(path, []byte(skey+"\n"), 0o600); err != nil {
			return nil, "", fmt.Errorf("write audit key: %w", err)
		}
		raw = []byte(skey)
	} else if err != nil {
		return nil, "", fmt.Errorf("read audit key: %w", err)
	}
	skey := strings.TrimSpace(string(raw))
	signer, err := note.NewSigner(skey)
	if err != nil {
		return nil, "", fmt.Errorf("audit key %s: %w", path, err)
	}
	vkey, err := verifierKeyOf(skey)
	if err != nil {
		return nil, "", fmt.Errorf("audit key %s: %w", path, err)
	}
	pub, err := os.ReadFile(filepath.Join(dir, keyPubFile))
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if err := atomicfile.WriteFile(filepath.Join(dir, keyPubFile), []byte(vkey+"\n"), 0o644); err != nil {
			return nil, "", fmt.Errorf("write audit public key: %w", err)
		}
	case err != nil:
		return nil, "", fmt.Errorf("read audit public key: %w", err)
	case strings.TrimSpace(string(pub)) != vkey:
		return nil, "", fmt.Errorf("audit public key %s does not belong to %s", keyPubFile, keyFile)
	}
	if signer.Name() != origin {
		return nil, "", fmt.Errorf("the audit log's key, and so its origin, is named %q, not %q: the origin is set when a log is made", signer.Name(), origin)
	}
	return signer, vkey, nil
}

// verifierKeyOf derives the verifier key from an Ed25519 note signer key.
func verifierKeyOf(skey string) (string, error) {
	parts := strings.SplitN(skey, "+", 5)
	if len(parts) != 5 {
		return "", errors.New("malformed signer key")
	}
	k, err := base64.StdEncoding.DecodeString(parts[4])
	if err != nil || len(k) != 1+ed25519.SeedSize || k[0] != 1 {
		return "", errors.New("not an Ed25519 signer key")
	}
	pub := ed25519.NewKeyFromSeed(k[1:]).Public().(ed25519.PublicKey)
	return note.NewEd25519VerifierKey(parts[2], pub)
}

// PublicKey returns the verifier key of the log in dir (key.pub), as
// `carrel audit key` prints it.
func PublicKey(dir string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dir, keyPubFile))
	if err != nil {
		return "", fmt.Errorf("read audit public key: %w", err)
	}
	vkey := strings.TrimSpace(string(b))
	if _, err := note.NewVerifier(vkey); err != nil {
		return "", fmt.Errorf("audit public key %s: %w", filepath.Join(dir, keyPubFile), err)
	}
	return vkey, nil
}

// Signer returns the signing key of the log in dir, without making one:
// for signing what is made of the log (an evidence bundle's manifest).
// Its file is readable by root alone.
func Signer(dir string) (note.Signer, error) {
	raw, err := os.ReadFile(filepath.Join(dir, keyFile))
	if err != nil {
		return nil, fmt.Errorf("the log's signing key: %w", err)
	}
	return note.NewSigner(strings.TrimSpace(string(raw)))
}
