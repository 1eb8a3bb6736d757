// Package witness cosigns carrel's audit checkpoints, and asks others to:
// the C2SP tlog-witness protocol (POST /add-checkpoint with a consistency
// proof from the last checkpoint the witness saw) and cosignature/v1
// signatures (C2SP tlog-cosignature), as the transparency-log witness
// networks speak them.
//
// A witness keeps, for each log it knows, the latest checkpoint it
// cosigned, and cosigns a new one only if it extends that one (the
// consistency proof checks). So a host that rewrites its own log and signs
// it again with its own key cannot get the rewritten checkpoints cosigned,
// and `carrel audit verify --witness KEY` catches the rewrite.
package witness

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

// algCosignatureV1 is the signature type byte of a cosignature/v1 key
// (C2SP signed-note).
const algCosignatureV1 = 0x04

// sigLen is a cosignature's length after its key hash: a big-endian
// timestamp, then the Ed25519 signature.
const sigLen = 8 + ed25519.SignatureSize

// Signer cosigns checkpoints: a note.Signer.
type Signer struct {
	name string
	hash uint32
	priv ed25519.PrivateKey
	// Now gives the cosignature's time; time.Now when nil.
	Now func() time.Time
}

// Verifier checks cosignatures: a note.Verifier.
type Verifier struct {
	name string
	hash uint32
	pub  ed25519.PublicKey
}

// GenerateKey makes a witness key named name: skey, the private key for
// NewSigner (keep it secret), and vkey, the verifier key to hand out.
func GenerateKey(name string) (skey, vkey string, err error) {
	if !validName(name) {
		return "", "", fmt.Errorf("witness name %q: want a non-empty name without spaces or '+'", name)
	}
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return "", "", err
	}
	key := append([]byte{algCosignatureV1}, pub...)
	h := keyHash(name, key)
	vkey = fmt.Sprintf("%s+%08x+%s", name, h, base64.StdEncoding.EncodeToString(key))
	skey = fmt.Sprintf("PRIVATE+KEY+%s+%08x+%s", name, h, base64.StdEncoding.EncodeToString(append([]byte{algCosignatureV1}, priv.Seed()...)))
	return skey, vkey, nil
}

// NewSigner reads a private key GenerateKey made.
func NewSigner(skey string) (*Signer, error) {
	rest, ok := strings.CutPrefix(strings.TrimSpace(skey), "PRIVATE+KEY+")
	if !ok {
		return nil, errors.New("witness private key: not PRIVATE+KEY+NAME+HASH+KEY")
	}
	name, hash, key, err := splitKey(rest)
	if err != nil {
		return nil, fmt.Errorf("witness private key: %w", err)
	}
	if len(key) != 1+ed25519.SeedSize {
		return nil, errors.New("witness private key: not a cosignature/v1 Ed25519 key")
	}
	priv := ed25519.NewKeyFromSeed(key[1:])
	pub := append([]byte{algCosignatureV1}, priv.Public().(ed25519.PublicKey)...)
	if keyHash(name, pub) != hash {
		return nil, errors.New("witness private key: its hash does not match its key")
	}
	return &Signer{name: name, hash: hash, priv: priv}, nil
}

// NewVerifier reads a verifier key ("NAME+HASH+KEY").
func NewVerifier(vkey string) (*Verifier, error) {
	name, hash, key, err := splitKey(strings.TrimSpace(vkey))
	if err != nil {
		return nil, fmt.Errorf("witness key: %w", err)
	}
	if keyHash(name, key) != hash {
		return nil, errors.New("witness key: its hash does not match its key")
	}
	return &Verifier{name: name, hash: hash, pub: ed25519.PublicKey(key[1:])}, nil
}

func splitKey(s string) (name string, hash uint32, key []byte, err error) {
	parts := strings.SplitN(s, "+", 3)
	if len(parts) != 3 || !validName(parts[0]) || len(parts[1]) != 8 {
		return "", 0, nil, errors.New("not NAME+HASH+KEY")
	}
	h, err := strconv.ParseUint(parts[1], 16, 32)
	if err != nil {
		return "", 0, nil, errors.New("its hash is not 8 hex digits")
	}
	key, err = base64.StdEncoding.DecodeString(parts[2])
	if err != nil || len(key) < 1 || key[0] != algCosignatureV1 {
		return "", 0, nil, errors.New("not a cosignature/v1 key")
	}
	if len(key) != 1+ed25519.PublicKeySize && len(key) != 1+ed25519.SeedSize {
		return "", 0, nil, errors.New("a key of the wrong length")
	}
	return parts[0], uint32(h), key, nil
}

// keyHash is signed-note's key ID: the first four bytes of
// SHA-256(name || "\n" || type || key).
func keyHash(name string, key []byte) uint32 {
	h := sha256.New()
	h.Write([]byte(name))
	h.Write([]byte("\n"))
	h.Write(key)
	return binary.BigEndian.Uint32(h.Sum(nil))
}

func validName(name string) bool {
	return name != "" && utf8.ValidString(name) && strings.IndexFunc(name, unicode.IsSpace) < 0 && !strings.Contains(name, "+")
}

// signedMessage is what a cosignature/v1 signs: its header line, the time,
// then the checkpoint's text.
func signedMessage(ts uint64, text []byte) []byte {
	return append(fmt.Appendf(nil, "cosignature/v1\ntime %d\n", ts), text...)
}

func (s *Signer) Name() string    { return s.name }
func (s *Signer) KeyHash() uint32 { return s.hash }

// Sign cosigns a checkpoint's text at the current time.
func (s *Signer) Sign(text []byte) ([]byte, error) {
	now := time.Now
	if s.Now != nil {
		now = s.Now
	}
	ts := uint64(now().Unix())
	sig := make([]byte, 8, sigLen)
	binary.BigEndian.PutUint64(sig, ts)
	return append(sig, ed25519.Sign(s.priv, signedMessage(ts, text))...), nil
}

func (v *Verifier) Name() string    { return v.name }
func (v *Verifier) KeyHash() uint32 { return v.hash }

// Verify checks a cosignature of a checkpoint's text.
func (v *Verifier) Verify(text, sig []byte) bool {
	if len(sig) != sigLen {
		return false
	}
	ts := binary.BigEndian.Uint64(sig)
	return ed25519.Verify(v.pub, signedMessage(ts, text), sig[8:])
}

// Time is when a cosignature says it was made; zero for a malformed one.
func Time(sig []byte) time.Time {
	if len(sig) != sigLen {
		return time.Time{}
	}
	return time.Unix(int64(binary.BigEndian.Uint64(sig)), 0).UTC()
}
