package identity

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/carrel-os/carrel/supervisor/atomicfile"
)

// ErrNoSuchToken is returned by Revoke for an unknown id.
var ErrNoSuchToken = errors.New("no such token")

// maxTokens bounds the token file.
const maxTokens = 10000

// Token is one issued token, scoped to one VM, or an API key (Key set).
// Only the sha256 of its secret is kept.
type Token struct {
	ID        string    `json:"id"`
	VM        string    `json:"vm"`
	Hash      string    `json:"sha256"`
	CreatedAt time.Time `json:"created_at"`
	ExpiresAt time.Time `json:"expires_at,omitzero"`
	// Key is set for an API key: whose it is and what its VMs may be.
	Key *Key `json:"key,omitempty"`
}

// Tokens is the token file: <state>/tokens.json, written atomically, and
// the secret sandbox tokens are made with, beside it.
type Tokens struct {
	path       string
	sandboxKey []byte
	mu         sync.RWMutex
	byID       map[string]Token
}

// OpenTokens loads the token file, if there is one, and the sandbox
// token secret (PATH.sandbox-key), made on first use.
func OpenTokens(path string) (*Tokens, error) {
	t := &Tokens{path: path, byID: map[string]Token{}}
	key, err := loadSandboxKey(path + ".sandbox-key")
	if err != nil {
		return nil, err
	}
	t.sandboxKey = key
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return t, nil
	}
	if err != nil {
		return nil, err
	}
	var list []Token
	if err := json.Unmarshal(b, &list); err != nil {
		return nil, fmt.Errorf("token file %s: %w", path, err)
	}
	for _, tok := range list {
		t.byID[tok.ID] = tok
	}
	return t, nil
}

// Create issues a token for vm and returns it with its secret, which is
// shown once: "carrel_<id>_<secret>".
func (t *Tokens) Create(vm string, ttl time.Duration) (Token, string, error) {
	var id, secret [16]byte
	rand.Read(id[:])
	rand.Read(secret[:])
	tok := Token{ID: hex.EncodeToString(id[:8]), VM: vm, CreatedAt: time.Now().UTC().Truncate(time.Second)}
	if ttl > 0 {
		tok.ExpiresAt = tok.CreatedAt.Add(ttl)
	}
	s := hex.EncodeToString(secret[:])
	tok.Hash = hashSecret(s)
	if err := t.add(tok); err != nil {
		return Token{}, "", err
	}
	return tok, "carrel_" + tok.ID + "_" + s, nil
}

func (t *Tokens) add(tok Token) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.byID) >= maxTokens {
		return fmt.Errorf("%d tokens exist; revoke some first", len(t.byID))
	}
	t.byID[tok.ID] = tok
	if err := t.saveLocked(); err != nil {
		delete(t.byID, tok.ID)
		return err
	}
	return nil
}

// Verify returns the token a secret belongs to, if it is valid now: a VM
// token ("carrel_<id>_<secret>") or an API key ("e2b_<id><secret>").
func (t *Tokens) Verify(full string) (Token, error) {
	if rest, ok := strings.CutPrefix(full, keyPrefix); ok {
		if len(rest) != 48 || !isLowerHex(rest) {
			return Token{}, errors.Join(ErrUnauthenticated, errors.New("malformed API key"))
		}
		return t.verify(rest[:16], rest[16:], true)
	}
	rest, ok := strings.CutPrefix(full, "carrel_")
	id, secret, ok2 := strings.Cut(rest, "_")
	if !ok || !ok2 || len(id) != 16 || len(secret) != 32 {
		return Token{}, errors.Join(ErrUnauthenticated, errors.New("malformed token"))
	}
	return t.verify(id, secret, false)
}

func (t *Tokens) verify(id, secret string, key bool) (Token, error) {
	t.mu.RLock()
	tok, found := t.byID[id]
	t.mu.RUnlock()
	want := tok.Hash
	if !found {
		want = strings.Repeat("0", 64) // compare anyway: no timing signal for unknown ids
	}
	if subtle.ConstantTimeCompare([]byte(hashSecret(secret)), []byte(want)) != 1 || !found || (tok.Key != nil) != key {
		return Token{}, errors.Join(ErrUnauthenticated, errors.New("unknown or revoked token"))
	}
	if !tok.ExpiresAt.IsZero() && time.Now().After(tok.ExpiresAt) {
		return Token{}, errors.Join(ErrUnauthenticated, fmt.Errorf("token %s expired at %s", tok.ID, tok.ExpiresAt.Format(time.RFC3339)))
	}
	return tok, nil
}

// List returns every token, oldest first.
func (t *Tokens) List() []Token {
	t.mu.RLock()
	defer t.mu.RUnlock()
	out := make([]Token, 0, len(t.byID))
	for _, tok := range t.byID {
		out = append(out, tok)
	}
	slices.SortFunc(out, func(a, b Token) int { return a.CreatedAt.Compare(b.CreatedAt)*2 + strings.Compare(a.ID, b.ID) })
	return out
}

// Revoke deletes a token; it stops working at once.
func (t *Tokens) Revoke(id string) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	tok, ok := t.byID[id]
	if !ok {
		return fmt.Errorf("%w: %q", ErrNoSuchToken, id)
	}
	delete(t.byID, id)
	if err := t.saveLocked(); err != nil {
		t.byID[id] = tok
		return err
	}
	return nil
}

// RevokeVM deletes every token scoped to vm (when the VM is deleted, so
// that a new VM of the same name does not inherit them).
func (t *Tokens) RevokeVM(vm string) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	changed := false
	for id, tok := range t.byID {
		if tok.VM == vm {
			delete(t.byID, id)
			changed = true
		}
	}
	if !changed {
		return nil
	}
	return t.saveLocked()
}

func (t *Tokens) saveLocked() error {
	list := make([]Token, 0, len(t.byID))
	for _, tok := range t.byID {
		list = append(list, tok)
	}
	slices.SortFunc(list, func(a, b Token) int { return strings.Compare(a.ID, b.ID) })
	b, err := json.MarshalIndent(list, "", "  ")
	if err != nil {
		return err
	}
	return atomicfile.WriteFile(t.path, b, 0o600)
}

func hashSecret(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}
