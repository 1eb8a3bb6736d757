package identity

import (
	"context"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/audit"
)

func openTokens(t *testing.T) (*Tokens, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "tokens.json")
	tk, err := OpenTokens(path)
	if err != nil {
		t.Fatal(err)
	}
	return tk, path
}

func createKey(t *testing.T, tk *Tokens, k Key) (Token, string) {
	t.Helper()
	tok, secret, err := tk.CreateKey(k, 0)
	if err != nil {
		t.Fatal(err)
	}
	return tok, secret
}

// flipLast changes the last hex digit of s to another hex digit.
func flipLast(s string) string {
	last := s[len(s)-1]
	repl := byte('0')
	if last == '0' {
		repl = '1'
	}
	return s[:len(s)-1] + string(repl)
}

// expire sets token id's expiry in the past, as if its time had passed.
func expire(t *testing.T, tk *Tokens, id string) {
	t.Helper()
	tk.mu.Lock()
	defer tk.mu.Unlock()
	tok, ok := tk.byID[id]
	if !ok {
		t.Fatalf("no token %s", id)
	}
	tok.ExpiresAt = time.Now().Add(-time.Minute)
	tk.byID[id] = tok
}

func TestCreateKeyRefusesBadInput(t *testing.T) {
	tk, path := openTokens(t)
	tests := []struct {
		name string
		k    Key
		want string
	}{
		{"empty name", Key{Name: "", Images: []string{"*"}}, "key name"},
		{"upper case", Key{Name: "Alice", Images: []string{"*"}}, "key name"},
		{"starts with a digit", Key{Name: "1abc", Images: []string{"*"}}, "key name"},
		{"dash", Key{Name: "a-b", Images: []string{"*"}}, "key name"},
		{"dot dot", Key{Name: "..", Images: []string{"*"}}, "key name"},
		{"17 characters", Key{Name: "a" + strings.Repeat("b", 16), Images: []string{"*"}}, "key name"},
		{"no images", Key{Name: "alice"}, "1 to 64 images"},
		{"empty images", Key{Name: "alice", Images: []string{}}, "1 to 64 images"},
		{"65 images", Key{Name: "alice", Images: make([]string, 65)}, "1 to 64 images"},
		{"an empty image", Key{Name: "alice", Images: []string{"dev", ""}}, "not a tag or digest"},
		{"a space", Key{Name: "alice", Images: []string{"dev base"}}, "not a tag or digest"},
		{"a tab", Key{Name: "alice", Images: []string{"dev\t"}}, "not a tag or digest"},
		{"a newline", Key{Name: "alice", Images: []string{"dev\n"}}, "not a tag or digest"},
		{"a NUL", Key{Name: "alice", Images: []string{"dev\x00"}}, "not a tag or digest"},
		{"257 bytes", Key{Name: "alice", Images: []string{strings.Repeat("x", 257)}}, "not a tag or digest"},
	}
	for _, tt := range tests {
		tok, secret, err := tk.CreateKey(tt.k, 0)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: err %v, want it to say %q", tt.name, err, tt.want)
		}
		if tok.ID != "" || secret != "" {
			t.Errorf("%s: returned %+v, %q with the error", tt.name, tok, secret)
		}
	}
	if n := len(tk.List()); n != 0 {
		t.Errorf("%d tokens kept after refused creates", n)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("token file written by refused creates: %v", err)
	}

	// The limits themselves are allowed.
	for _, k := range []Key{
		{Name: "a", Images: []string{"*"}},
		{Name: "a" + strings.Repeat("0", 15), Images: make([]string, 64)},
		{Name: "bob", Images: []string{strings.Repeat("x", 256), "sha256:" + strings.Repeat("ab", 32)}},
	} {
		if k.Images[0] == "" {
			for i := range k.Images {
				k.Images[i] = "img"
			}
		}
		if _, _, err := tk.CreateKey(k, 0); err != nil {
			t.Errorf("%s: %v", k.Name, err)
		}
	}
}

var keyForm = regexp.MustCompile(`^e2b_[0-9a-f]{48}$`)

func TestKeyVerify(t *testing.T) {
	tk, path := openTokens(t)
	k := Key{Name: "alice", Images: []string{"dev", "base"}, Policy: "strict"}
	tok, secret, err := tk.CreateKey(k, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if !keyForm.MatchString(secret) || !strings.HasPrefix(secret, "e2b_"+tok.ID) {
		t.Fatalf("key %q (id %s): want e2b_, the id, then the secret, in lower-case hex", secret, tok.ID)
	}
	if tok.VM != "" || tok.Key == nil || !reflect.DeepEqual(*tok.Key, k) {
		t.Errorf("token %+v, want key %+v and no VM", tok, k)
	}
	if want := tok.CreatedAt.Add(time.Hour); !tok.ExpiresAt.Equal(want) {
		t.Errorf("expires at %s, want %s", tok.ExpiresAt, want)
	}
	if strings.Contains(tok.Hash, secret[len("e2b_")+16:]) {
		t.Error("the secret itself is kept")
	}

	got, err := tk.Verify(secret)
	if err != nil {
		t.Fatal(err)
	}
	if got.ID != tok.ID || got.Key == nil || !reflect.DeepEqual(*got.Key, k) {
		t.Errorf("verified as %+v, want key %s", got, tok.ID)
	}

	// A key survives a restart.
	tk2, err := OpenTokens(path)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := tk2.Verify(secret); err != nil || got.Key == nil || got.Key.Name != "alice" {
		t.Errorf("after reopening: %+v, %v", got, err)
	}

	bad := map[string]string{
		"one digit changed": flipLast(secret),
		"upper case":        "e2b_" + strings.ToUpper(secret[4:]),
		"short":             secret[:len(secret)-1],
		"long":              secret + "0",
		"no prefix":         secret[4:],
		"other prefix":      "E2B_" + secret[4:],
		"empty":             "",
		"id alone":          "e2b_" + tok.ID,
		"not hex":           "e2b_" + tok.ID + strings.Repeat("g", 32),
		"as a VM token":     "carrel_" + tok.ID + "_" + secret[4+16:],
	}
	for name, s := range bad {
		if _, err := tk.Verify(s); !errors.Is(err, ErrUnauthenticated) {
			t.Errorf("%s (%q): %v, want unauthenticated", name, s, err)
		}
	}
}

// TestVMTokenIsNotAKey: a VM token's secret does not verify in a key's
// form, nor a key's in a VM token's.
func TestVMTokenIsNotAKey(t *testing.T) {
	tk, _ := openTokens(t)
	vmTok, vmSecret, err := tk.Create("demo", 0)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := tk.Verify(vmSecret); err != nil || got.Key != nil || got.VM != "demo" {
		t.Fatalf("VM token verified as %+v, %v", got, err)
	}
	_, vmRaw, _ := strings.Cut(strings.TrimPrefix(vmSecret, "carrel_"), "_")
	if _, err := tk.Verify("e2b_" + vmTok.ID + vmRaw); !errors.Is(err, ErrUnauthenticated) {
		t.Errorf("a VM token in a key's form: %v, want unauthenticated", err)
	}
	if _, err := tk.Verify(flipLast(vmSecret)); !errors.Is(err, ErrUnauthenticated) {
		t.Errorf("a VM token with a digit changed: %v", err)
	}
	if _, err := tk.VerifySandbox(tk.SandboxToken(vmTok.ID, "demo"), "demo"); !errors.Is(err, ErrUnauthenticated) {
		t.Errorf("a sandbox token made from a VM token: %v, want unauthenticated", err)
	}
}

func TestExpiredKeyIsRefused(t *testing.T) {
	tk, _ := openTokens(t)
	tok, secret := createKey(t, tk, Key{Name: "alice", Images: []string{"*"}})
	sbx := tk.SandboxToken(tok.ID, "e2b-alice-1")
	if _, err := tk.Verify(secret); err != nil {
		t.Fatal(err)
	}
	if _, err := tk.VerifySandbox(sbx, "e2b-alice-1"); err != nil {
		t.Fatal(err)
	}
	expire(t, tk, tok.ID)
	if _, err := tk.Verify(secret); !errors.Is(err, ErrUnauthenticated) || !strings.Contains(err.Error(), "expired") {
		t.Errorf("expired key: %v", err)
	}
	if _, err := tk.VerifySandbox(sbx, "e2b-alice-1"); !errors.Is(err, ErrUnauthenticated) || !strings.Contains(err.Error(), "expired") {
		t.Errorf("sandbox token of an expired key: %v", err)
	}
}

func TestRevokedKeyIsRefused(t *testing.T) {
	tk, path := openTokens(t)
	tok, secret := createKey(t, tk, Key{Name: "alice", Images: []string{"*"}})
	other, otherSecret := createKey(t, tk, Key{Name: "alice", Images: []string{"*"}})
	sbx := tk.SandboxToken(tok.ID, "e2b-alice-1")
	if err := tk.Revoke(tok.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := tk.Verify(secret); !errors.Is(err, ErrUnauthenticated) {
		t.Errorf("revoked key: %v", err)
	}
	if _, err := tk.VerifySandbox(sbx, "e2b-alice-1"); !errors.Is(err, ErrUnauthenticated) {
		t.Errorf("sandbox token of a revoked key: %v", err)
	}
	if err := tk.Revoke(tok.ID); !errors.Is(err, ErrNoSuchToken) {
		t.Errorf("second revoke: %v", err)
	}
	// Another key of the same name still works, after a restart too; the
	// revoked one stays revoked.
	tk2, err := OpenTokens(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tk2.Verify(secret); !errors.Is(err, ErrUnauthenticated) {
		t.Errorf("revoked key after reopening: %v", err)
	}
	if got, err := tk2.Verify(otherSecret); err != nil || got.ID != other.ID {
		t.Errorf("the other key: %+v, %v", got, err)
	}
}

func TestSandboxToken(t *testing.T) {
	tk, _ := openTokens(t)
	tok, _ := createKey(t, tk, Key{Name: "alice", Images: []string{"dev"}})
	const vm = "e2b-alice-0001"
	sbx := tk.SandboxToken(tok.ID, vm)
	if !regexp.MustCompile(`^e2bsbx_[0-9a-f]{16}_[0-9a-f]{64}$`).MatchString(sbx) || !strings.Contains(sbx, tok.ID) {
		t.Fatalf("sandbox token %q", sbx)
	}
	if tk.SandboxToken(tok.ID, vm) != sbx {
		t.Error("a sandbox token is not the same each time it is made")
	}
	got, err := tk.VerifySandbox(sbx, vm)
	if err != nil {
		t.Fatal(err)
	}
	if got.ID != tok.ID || got.Key == nil || got.Key.Name != "alice" {
		t.Errorf("verified as %+v", got)
	}
	for _, other := range []string{"e2b-alice-0002", "e2b-alice-000", vm + "1", "", strings.ToUpper(vm)} {
		if _, err := tk.VerifySandbox(sbx, other); !errors.Is(err, ErrUnauthenticated) {
			t.Errorf("for VM %q: %v, want unauthenticated", other, err)
		}
	}
	_, mac, _ := strings.Cut(strings.TrimPrefix(sbx, "e2bsbx_"), "_")
	malformed := map[string]string{
		"empty":             "",
		"prefix alone":      "e2bsbx_",
		"no mac":            "e2bsbx_" + tok.ID,
		"no separator":      "e2bsbx_" + tok.ID + mac,
		"short id":          "e2bsbx_" + tok.ID[1:] + "_" + mac,
		"short mac":         sbx[:len(sbx)-1],
		"long mac":          sbx + "0",
		"mac digit changed": flipLast(sbx),
		"upper-case mac":    "e2bsbx_" + tok.ID + "_" + strings.ToUpper(mac),
		"no prefix":         strings.TrimPrefix(sbx, "e2bsbx_"),
		"another prefix":    "carrel_" + strings.TrimPrefix(sbx, "e2bsbx_"),
		"the key's secret":  "e2b_" + tok.ID + mac[:32],
		"unknown id":        "e2bsbx_" + flipLast(tok.ID) + "_" + mac,
	}
	for name, s := range malformed {
		if _, err := tk.VerifySandbox(s, vm); !errors.Is(err, ErrUnauthenticated) {
			t.Errorf("%s (%q): %v, want unauthenticated", name, s, err)
		}
	}
	// A sandbox token is not a key.
	if _, err := tk.Verify(sbx); !errors.Is(err, ErrUnauthenticated) {
		t.Errorf("a sandbox token as a key: %v", err)
	}
	// Made for an id that names no key at all: refused.
	if _, err := tk.VerifySandbox(tk.SandboxToken(strings.Repeat("0", 16), vm), vm); !errors.Is(err, ErrUnauthenticated) {
		t.Errorf("sandbox token of no key: %v", err)
	}
}

// TestSandboxSecret: the secret sandbox tokens are made with is made once,
// readable by carreld alone, and reused, so sandbox tokens survive a
// restart; a file of the wrong size is refused, not replaced.
func TestSandboxSecret(t *testing.T) {
	tk, path := openTokens(t)
	tok, _ := createKey(t, tk, Key{Name: "alice", Images: []string{"*"}})
	keyPath := path + ".sandbox-key"
	fi, err := os.Stat(keyPath)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 || fi.Size() != 32 {
		t.Errorf("sandbox secret: mode %v, %d bytes; want 0600, 32", fi.Mode().Perm(), fi.Size())
	}
	secret, _ := os.ReadFile(keyPath)
	sbx := tk.SandboxToken(tok.ID, "e2b-alice-1")

	tk2, err := OpenTokens(path)
	if err != nil {
		t.Fatal(err)
	}
	if again, _ := os.ReadFile(keyPath); string(again) != string(secret) {
		t.Error("reopening made a new sandbox secret")
	}
	if tk2.SandboxToken(tok.ID, "e2b-alice-1") != sbx {
		t.Error("the sandbox token changed across a restart")
	}
	if _, err := tk2.VerifySandbox(sbx, "e2b-alice-1"); err != nil {
		t.Errorf("the sandbox token after a restart: %v", err)
	}

	// Another carreld, another secret: its sandbox tokens differ.
	other, _ := openTokens(t)
	if other.SandboxToken(tok.ID, "e2b-alice-1") == sbx {
		t.Error("two sandbox secrets made the same token")
	}

	for _, n := range []int{0, 31, 33, 64} {
		dir := t.TempDir()
		p := filepath.Join(dir, "tokens.json")
		if err := os.WriteFile(p+".sandbox-key", make([]byte, n), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := OpenTokens(p)
		if err == nil || !strings.Contains(err.Error(), "want 32") || !strings.Contains(err.Error(), p+".sandbox-key") {
			t.Errorf("a %d-byte sandbox secret: %v", n, err)
		}
		if b, _ := os.ReadFile(p + ".sandbox-key"); len(b) != n {
			t.Errorf("the %d-byte sandbox secret was replaced", n)
		}
	}
}

func TestAuthenticate(t *testing.T) {
	tk, _ := openTokens(t)
	k := Key{Name: "alice", Images: []string{"dev", "base"}, Policy: "strict"}
	tok, secret := createKey(t, tk, k)
	vmTok, vmSecret, err := tk.Create("demo", 0)
	if err != nil {
		t.Fatal(err)
	}
	const vm = "e2b-alice-1"
	sbx := tk.SandboxToken(tok.ID, vm)
	// A peer on the connection: a bad token must not fall back to it.
	ctx := context.WithValue(context.Background(), peerKey{}, Peer{UID: 1000, GID: 1000, PID: 42, Groups: []string{"agent"}})

	header := func(kv ...string) http.Header {
		h := http.Header{}
		for i := 0; i < len(kv); i += 2 {
			h.Set(kv[i], kv[i+1])
		}
		return h
	}
	wantKey := audit.Caller{Type: audit.CallerKey, KeyID: tok.ID, Name: "alice", Images: []string{"dev", "base"}, Policy: "strict"}
	wantSandbox := wantKey
	wantSandbox.VM = vm
	good := []struct {
		name string
		h    http.Header
		want audit.Caller
	}{
		{"a key", header("Authorization", "Bearer "+secret), wantKey},
		{"a key, with a VM named", header("Authorization", "Bearer "+secret, protocol.VMHeader, vm), wantKey},
		{"a sandbox token", header("Authorization", "Bearer "+sbx, protocol.VMHeader, vm), wantSandbox},
		{"a sandbox token, padded", header("Authorization", "Bearer  "+sbx+" ", protocol.VMHeader, vm), wantSandbox},
		{"a VM token", header("Authorization", "Bearer "+vmSecret), audit.Caller{Type: audit.CallerToken, TokenID: vmTok.ID, VM: "demo"}},
		{"the peer", header(), audit.Caller{Type: audit.CallerPeer, UID: 1000, GID: 1000, PID: 42, Groups: []string{"agent"}}},
	}
	for _, tt := range good {
		got, err := Authenticate(ctx, tt.h, tk)
		if err != nil || !reflect.DeepEqual(got, tt.want) {
			t.Errorf("%s: %+v, %v; want %+v", tt.name, got, err, tt.want)
		}
	}

	bad := []struct {
		name   string
		h      http.Header
		tokens *Tokens
	}{
		{"a sandbox token for another VM", header("Authorization", "Bearer "+sbx, protocol.VMHeader, "e2b-alice-2"), tk},
		{"a sandbox token, no VM named", header("Authorization", "Bearer "+sbx), tk},
		{"a key, a digit changed", header("Authorization", "Bearer "+flipLast(secret)), tk},
		{"not bearer", header("Authorization", "Basic "+secret), tk},
		{"bearer, nothing", header("Authorization", "Bearer "), tk},
		{"tokens not enabled", header("Authorization", "Bearer "+secret), nil},
	}
	for _, tt := range bad {
		got, err := Authenticate(ctx, tt.h, tt.tokens)
		if !errors.Is(err, ErrUnauthenticated) || !reflect.DeepEqual(got, audit.Caller{}) {
			t.Errorf("%s: %+v, %v; want unauthenticated", tt.name, got, err)
		}
	}
	if _, err := Authenticate(context.Background(), http.Header{}, tk); !errors.Is(err, ErrUnauthenticated) {
		t.Errorf("no peer and no token: %v", err)
	}

	// Revoking the key ends its sandbox tokens at once.
	if err := tk.Revoke(tok.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := Authenticate(ctx, header("Authorization", "Bearer "+sbx, protocol.VMHeader, vm), tk); !errors.Is(err, ErrUnauthenticated) {
		t.Errorf("sandbox token of a revoked key: %v", err)
	}
}

func TestSees(t *testing.T) {
	key := audit.Caller{Type: audit.CallerKey, KeyID: "0123456789abcdef", Name: "ab"}
	sandbox := key
	sandbox.VM = "e2b-ab-0001"
	tests := []struct {
		caller audit.Caller
		vm     string
		want   bool
	}{
		{audit.Caller{Type: audit.CallerPeer}, "anything", true},
		{audit.Caller{Type: audit.CallerToken, VM: "demo"}, "other", false}, // a VM token sees its VM alone
		{audit.Caller{Type: audit.CallerToken, VM: "demo"}, "demo", true},
		{key, "e2b-ab-0001", true},
		{key, "e2b-ab-x", true},
		{key, "e2b-abc-0001", false}, // another key's, whose name begins with this one's
		{key, "e2b-a-0001", false},
		{key, "e2b-ab", false},
		{key, "demo", false},
		{key, "ab", false},
		{sandbox, "e2b-ab-0001", true},
		{sandbox, "e2b-ab-0002", false},
		{sandbox, "demo", false},
	}
	for _, tt := range tests {
		if got := Sees(tt.caller, tt.vm); got != tt.want {
			t.Errorf("Sees(%s %q scoped to %q, %q) = %v, want %v", tt.caller.Type, tt.caller.Name, tt.caller.VM, tt.vm, got, tt.want)
		}
	}
	if got := KeyVMPrefix("ab"); got != "e2b-ab-" {
		t.Errorf("KeyVMPrefix = %q", got)
	}
}

// TestKeyLimits: a key's limits are kept, through a restart, and given
// by its id until it is revoked; keys of one name must give the same
// limits, as they must the same images and policy.
func TestKeyLimits(t *testing.T) {
	tk, path := openTokens(t)
	lim := Limits{VMs: 3, Snapshots: 5, MemoryBytes: 16 << 30, DiskBytes: 100<<30 + 512<<20}
	tok, _ := createKey(t, tk, Key{Name: "alice", Images: []string{"dev"}, Limits: lim})
	if got, ok := tk.LimitsOf(tok.ID); !ok || got != lim {
		t.Errorf("LimitsOf = %+v, %v; want %+v", got, ok, lim)
	}
	if want := "max-vms=3,max-snapshots=5,max-memory=16G,max-disk=102912M"; lim.String() != want {
		t.Errorf("String() = %q, want %q", lim.String(), want)
	}
	if s := (Limits{}).String(); s != "none" {
		t.Errorf("no limits: %q, want none", s)
	}
	tk2, err := OpenTokens(path)
	if err != nil {
		t.Fatal(err)
	}
	if got, ok := tk2.LimitsOf(tok.ID); !ok || got != lim {
		t.Errorf("after reopening: %+v, %v; want %+v", got, ok, lim)
	}
	// A key without limits writes none.
	free, _ := createKey(t, tk, Key{Name: "bob", Images: []string{"dev"}})
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(b), `"limits"`); n != 1 {
		t.Errorf("the token file has %d limits, want alice's alone:\n%s", n, b)
	}
	if got, ok := tk.LimitsOf(free.ID); !ok || got != (Limits{}) {
		t.Errorf("bob's limits: %+v, %v; want none", got, ok)
	}

	// Keys of one name agree on their limits.
	for _, other := range []Limits{{}, {VMs: 4, Snapshots: 5, MemoryBytes: 16 << 30, DiskBytes: lim.DiskBytes}} {
		if _, _, err := tk.CreateKey(Key{Name: "alice", Images: []string{"dev"}, Limits: other}, 0); err == nil || !strings.Contains(err.Error(), "max-vms=3") {
			t.Errorf("a second alice key with limits %s: %v, want refused naming the first's", other, err)
		}
	}
	if _, _, err := tk.CreateKey(Key{Name: "alice", Images: []string{"dev"}, Limits: lim}, 0); err != nil {
		t.Errorf("a second alice key with the same limits: %v", err)
	}
	// Sizes are whole MiB, as VMs' are.
	for _, bad := range []Limits{{MemoryBytes: 1<<30 + 1}, {DiskBytes: 1000}} {
		if _, _, err := tk.CreateKey(Key{Name: "carol", Images: []string{"dev"}, Limits: bad}, 0); err == nil || !strings.Contains(err.Error(), "whole MiB") {
			t.Errorf("limits %+v: %v, want refused", bad, err)
		}
	}

	if err := tk.Revoke(tok.ID); err != nil {
		t.Fatal(err)
	}
	if _, ok := tk.LimitsOf(tok.ID); ok {
		t.Error("a revoked key still has limits")
	}
	vmTok, _, _ := tk.Create("demo", 0)
	if _, ok := tk.LimitsOf(vmTok.ID); ok {
		t.Error("a VM token has a key's limits")
	}
}
