package identity

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/carrel-os/carrel/supervisor/atomicfile"
	"github.com/carrel-os/carrel/supervisor/audit"
)

// An API key is a token that is not scoped to one VM: it names an
// identity that creates VMs of its own, named KeyVMPrefix(name)+"...",
// and acts on those alone (the policy's carrel.api.key rule says so). It
// is what the e2b API's X-API-KEY carries, so it has e2b's form: "e2b_"
// and hex (its id, then its secret).
//
// A sandbox token is derived from a key and one of its VMs: an HMAC, by a
// secret of this carreld's, of the key's id and the VM's name. It acts as
// the key, on that VM only, and is what an e2b client sends to the VM's
// envd (the create reply's envdAccessToken). Nothing is stored for it: it
// stops working when its key is revoked.
const (
	keyPrefix     = "e2b_"
	sandboxPrefix = "e2bsbx_"
	maxKeyImages  = 64
)

// Key is what an API key may do.
type Key struct {
	// Name is the identity: keys of one name share its VMs.
	Name string `json:"name"`
	// Images are the tags (or digests) its VMs may boot; "*" is any.
	Images []string `json:"images"`
	// Policy binds its VMs; "" is "default".
	Policy string `json:"policy,omitempty"`
	// Limits cap what its VMs hold together.
	Limits Limits `json:"limits,omitzero"`
}

// Limits cap what the VMs of a key's name hold together: how many VMs,
// in any state, how many snapshots across them, and the sum of their
// memory and of their disks (vm.FootprintOf). 0 is no limit. They are
// the name's, as its images and policy are: keys of one name share its
// VMs, so they must agree on them (CreateKey). Each key carries them
// rather than the name once, so that a name is still its keys alone: it
// goes with the last of them, and is changed as its images are, by
// revoking its keys and issuing one with the new limits.
type Limits struct {
	VMs         uint64 `json:"vms,omitempty"`
	Snapshots   uint64 `json:"snapshots,omitempty"`
	MemoryBytes uint64 `json:"memory_bytes,omitempty"`
	DiskBytes   uint64 `json:"disk_bytes,omitempty"`
}

var keyName = regexp.MustCompile(`^[a-z][a-z0-9]{0,15}$`)

// KeyVMPrefix is how the names of the VMs of key name begin.
func KeyVMPrefix(name string) string { return "e2b-" + name + "-" }

// CreateKey issues an API key and returns it with its secret, which is
// shown once.
func (t *Tokens) CreateKey(k Key, ttl time.Duration) (Token, string, error) {
	if !keyName.MatchString(k.Name) {
		return Token{}, "", fmt.Errorf("key name %q: want 1-16 lower-case letters and digits, starting with a letter", k.Name)
	}
	if len(k.Images) == 0 || len(k.Images) > maxKeyImages {
		return Token{}, "", fmt.Errorf("a key names 1 to %d images its VMs may boot (\"*\" for any)", maxKeyImages)
	}
	for _, img := range k.Images {
		if img == "" || len(img) > 256 || strings.ContainsAny(img, " \t\n\x00") {
			return Token{}, "", fmt.Errorf("image %q: not a tag or digest", img)
		}
	}
	if k.Limits.MemoryBytes%(1<<20) != 0 || k.Limits.DiskBytes%(1<<20) != 0 {
		return Token{}, "", errors.New("a key's memory and disk limits are whole MiB, as VMs' sizes are")
	}
	// Keys of one name share its VMs, so they share what those may be.
	t.mu.RLock()
	for _, other := range t.byID {
		if o := other.Key; o != nil && o.Name == k.Name && (o.Policy != k.Policy || !slices.Equal(o.Images, k.Images) || o.Limits != k.Limits) {
			t.mu.RUnlock()
			return Token{}, "", fmt.Errorf("key %s of name %q grants images %v under policy %q with limits %s: keys of one name share its VMs, so a new one must grant the same (revoke the others first to change them)", other.ID, k.Name, o.Images, o.Policy, o.Limits)
		}
	}
	t.mu.RUnlock()
	var id, secret [16]byte
	rand.Read(id[:])
	rand.Read(secret[:])
	tok := Token{ID: hex.EncodeToString(id[:8]), CreatedAt: time.Now().UTC().Truncate(time.Second), Key: &k}
	if ttl > 0 {
		tok.ExpiresAt = tok.CreatedAt.Add(ttl)
	}
	s := hex.EncodeToString(secret[:])
	tok.Hash = hashSecret(s)
	if err := t.add(tok); err != nil {
		return Token{}, "", err
	}
	return tok, keyPrefix + tok.ID + s, nil
}

// LimitsOf returns the limits of API key id; false when there is no such
// key (it was revoked).
func (t *Tokens) LimitsOf(id string) (Limits, bool) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	tok, ok := t.byID[id]
	if !ok || tok.Key == nil {
		return Limits{}, false
	}
	return tok.Key.Limits, true
}

// String writes l as the flags of carrel key create would give it.
func (l Limits) String() string {
	if l == (Limits{}) {
		return "none"
	}
	var parts []string
	add := func(name string, n uint64, bytes bool) {
		switch {
		case n == 0:
		case bytes && n%(1<<30) == 0:
			parts = append(parts, fmt.Sprintf("%s=%dG", name, n>>30))
		case bytes:
			parts = append(parts, fmt.Sprintf("%s=%dM", name, n>>20))
		default:
			parts = append(parts, fmt.Sprintf("%s=%d", name, n))
		}
	}
	add("max-vms", l.VMs, false)
	add("max-snapshots", l.Snapshots, false)
	add("max-memory", l.MemoryBytes, true)
	add("max-disk", l.DiskBytes, true)
	return strings.Join(parts, ",")
}

// SandboxToken is the token that acts as key id on its VM vm alone.
func (t *Tokens) SandboxToken(id, vm string) string {
	return sandboxPrefix + id + "_" + t.sandboxMAC(id, vm)
}

func (t *Tokens) sandboxMAC(id, vm string) string {
	m := hmac.New(sha256.New, t.sandboxKey)
	m.Write([]byte(id))
	m.Write([]byte{0})
	m.Write([]byte(vm))
	return hex.EncodeToString(m.Sum(nil))
}

// VerifySandbox checks a sandbox token for vm and returns its key.
func (t *Tokens) VerifySandbox(full, vm string) (Token, error) {
	rest, ok := strings.CutPrefix(full, sandboxPrefix)
	id, mac, ok2 := strings.Cut(rest, "_")
	if !ok || !ok2 || len(id) != 16 || len(mac) != 64 || vm == "" {
		return Token{}, errors.Join(ErrUnauthenticated, errors.New("malformed sandbox token, or no VM named"))
	}
	if !hmac.Equal([]byte(mac), []byte(t.sandboxMAC(id, vm))) {
		return Token{}, errors.Join(ErrUnauthenticated, errors.New("the sandbox token is not for this VM"))
	}
	t.mu.RLock()
	tok, found := t.byID[id]
	t.mu.RUnlock()
	if !found || tok.Key == nil {
		return Token{}, errors.Join(ErrUnauthenticated, errors.New("the sandbox token's key is revoked"))
	}
	if !tok.ExpiresAt.IsZero() && time.Now().After(tok.ExpiresAt) {
		return Token{}, errors.Join(ErrUnauthenticated, fmt.Errorf("key %s expired at %s", tok.ID, tok.ExpiresAt.Format(time.RFC3339)))
	}
	return tok, nil
}

// keyCaller is the policy's caller for a key, scoped to vm when not "".
func keyCaller(tok Token, vm string) audit.Caller {
	return audit.Caller{Type: audit.CallerKey, KeyID: tok.ID, Name: tok.Key.Name, Images: tok.Key.Images, Policy: tok.Key.Policy, VM: vm}
}

// Sees reports whether caller may see VM name in a listing: a key sees
// only its own VMs (and a sandbox token only its one), a VM token its VM
// alone; anyone else sees every VM the policy let it list.
func Sees(caller audit.Caller, name string) bool {
	switch caller.Type {
	case audit.CallerToken:
		return caller.VM != "" && caller.VM == name
	case audit.CallerKey:
	default:
		return true
	}
	if caller.VM != "" {
		return caller.VM == name
	}
	return strings.HasPrefix(name, KeyVMPrefix(caller.Name))
}

func isLowerHex(s string) bool {
	for _, c := range []byte(s) {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// loadSandboxKey reads the sandbox token secret, making it the first time.
func loadSandboxKey(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err == nil {
		if len(b) != 32 {
			return nil, fmt.Errorf("sandbox token secret %s: %d bytes, want 32 (remove it to make a new one; sandbox tokens then change)", path, len(b))
		}
		return b, nil
	}
	if !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	b = make([]byte, 32)
	rand.Read(b)
	if err := atomicfile.WriteFile(path, b, 0o600); err != nil {
		return nil, fmt.Errorf("sandbox token secret: %w", err)
	}
	return b, nil
}
