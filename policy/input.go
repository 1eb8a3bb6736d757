package policy

import (
	"fmt"
	"path"
	"strings"
	"unicode/utf8"

	"github.com/open-policy-agent/opa/v1/ast"

	"github.com/carrel-os/carrel/supervisor/audit"
)

// InputVersion is the version of every input document; rules may check
// input.version to refuse documents they were not written for.
const InputVersion = 1

// Caps on what an input may hold. Inputs are built from callers' requests
// and guests' messages, so nothing in them is trusted.
const (
	MaxArgs        = 4096
	MaxEnv         = 1024
	MaxStringBytes = 64 << 10
	MaxPathBytes   = 4096
	MaxInputBytes  = 1 << 20
)

// Kind names a policy package: data.carrel.<kind>.decision decides it.
type Kind string

const (
	KindAPI   Kind = "api"
	KindExec  Kind = "exec"
	KindFS    Kind = "fs"
	KindNet   Kind = "net"
	KindGuest Kind = "guest"
)

// Kinds lists every kind; a bundle must decide each.
var Kinds = []Kind{KindAPI, KindExec, KindFS, KindNet, KindGuest}

// An Input is one of the typed input documents (input_*.go). Normalize checks it
// and puts it in canonical form; Decide calls it before evaluation.
type Input interface {
	Kind() Kind
	Normalize() error
	VMName() string
	value() ast.Value
}

// Caller is who made an API call: a local process (SO_PEERCRED) or the
// holder of a token. Its JSON, exactly the fields the rules see, is the
// audit log's (audit.Caller), so a recorded input decodes back to the
// document that was decided.
type Caller = audit.Caller

const (
	CallerPeer  = audit.CallerPeer
	CallerToken = audit.CallerToken
	CallerKey   = audit.CallerKey
)

func normalizeCaller(c Caller) error {
	switch c.Type {
	case CallerPeer, CallerToken, CallerKey:
	default:
		return fmt.Errorf("%w: caller type %q", ErrInvalidInput, c.Type)
	}
	if len(c.Groups) > 256 {
		return fmt.Errorf("%w: caller in %d groups, limit 256", ErrInvalidInput, len(c.Groups))
	}
	if err := checkStrings("caller groups", c.Groups...); err != nil {
		return err
	}
	if len(c.Images) > 256 {
		return fmt.Errorf("%w: caller may boot %d images, limit 256", ErrInvalidInput, len(c.Images))
	}
	if err := checkStrings("caller images", c.Images...); err != nil {
		return err
	}
	return checkStrings("caller", c.TokenID, c.VM, c.KeyID, c.Name, c.Policy)
}

// Keys and fixed values of input documents, built once and shared by
// every decision: evaluation never changes a term (OPA shares its own
// interned terms the same way), and building them per call was a fifth
// of a decision's allocations.
var (
	keyVersion   = ast.StringTerm("version")
	keyCaller    = ast.StringTerm("caller")
	keyType      = ast.StringTerm("type")
	keyUID       = ast.StringTerm("uid")
	keyGID       = ast.StringTerm("gid")
	keyPID       = ast.StringTerm("pid")
	keyGroups    = ast.StringTerm("groups")
	keyTokenID   = ast.StringTerm("token_id")
	keyVM        = ast.StringTerm("vm")
	keyDaemonUID = ast.StringTerm("daemon_uid")
	keyProcedure = ast.StringTerm("procedure")
	keyArgv      = ast.StringTerm("argv")
	keyEnv       = ast.StringTerm("env")
	keyCwd       = ast.StringTerm("cwd")
	keyUser      = ast.StringTerm("user")
	keyTTY       = ast.StringTerm("tty")
	keyOperation = ast.StringTerm("operation")
	keyPath      = ast.StringTerm("path")
	keyRecursive = ast.StringTerm("recursive")
	keyDirection = ast.StringTerm("direction")
	keyHost      = ast.StringTerm("host")
	keyPort      = ast.StringTerm("port")
	keyProtocol  = ast.StringTerm("protocol")
	keyRequest   = ast.StringTerm("request")
	keyArgs      = ast.StringTerm("args")
	keyIPLiteral = ast.StringTerm("ip_literal")
	keyAddresses = ast.StringTerm("addresses")
	keyIP        = ast.StringTerm("ip")
	keyClass     = ast.StringTerm("class")
	keyGPUs      = ast.StringTerm("gpus")
	keyKeyID     = ast.StringTerm("key_id")
	keyName      = ast.StringTerm("name")
	keyImages    = ast.StringTerm("images")
	keyPolicy    = ast.StringTerm("policy")
	keyImage     = ast.StringTerm("image")
	keyVMPolicy  = ast.StringTerm("vm_policy")

	versionTerm = ast.IntNumberTerm(InputVersion)
	fixedTerms  = func() map[string]*ast.Term {
		m := map[string]*ast.Term{}
		for _, s := range []string{CallerPeer, CallerToken, CallerKey, OpRead, OpWrite, OpCreate, OpDelete, OpChmod, OpList, OpWatch,
			DirEgress, DirForward, "tcp", "udp", DefaultUser, DefaultCwd,
			ClassPublic, ClassPrivate, ClassLoopback, ClassLinkLocal, ClassCGNAT, ClassUnspecified, ClassMulticast, ClassMetadata, ClassReserved} {
			m[s] = ast.StringTerm(s)
		}
		return m
	}()
)

// stringTerm is s as a term, a shared one if s is one of fixedTerms.
func stringTerm(s string) *ast.Term {
	if t, ok := fixedTerms[s]; ok {
		return t
	}
	return ast.StringTerm(s)
}

func callerValue(c Caller) ast.Value {
	if c.Type == CallerPeer {
		groups := make([]*ast.Term, len(c.Groups))
		for i, g := range c.Groups {
			groups[i] = ast.StringTerm(g)
		}
		return ast.NewObject(
			ast.Item(keyType, stringTerm(c.Type)),
			ast.Item(keyUID, ast.InternedTerm(c.UID)),
			ast.Item(keyGID, ast.InternedTerm(c.GID)),
			ast.Item(keyPID, ast.InternedTerm(c.PID)),
			ast.Item(keyGroups, ast.ArrayTerm(groups...)),
		)
	}
	if c.Type == CallerKey {
		return ast.NewObject(
			ast.Item(keyType, stringTerm(c.Type)),
			ast.Item(keyKeyID, ast.StringTerm(c.KeyID)),
			ast.Item(keyName, ast.StringTerm(c.Name)),
			ast.Item(keyImages, stringsTerm(c.Images)),
			ast.Item(keyPolicy, ast.StringTerm(c.Policy)),
			ast.Item(keyVM, ast.StringTerm(c.VM)),
		)
	}
	return ast.NewObject(
		ast.Item(keyType, stringTerm(c.Type)),
		ast.Item(keyTokenID, ast.StringTerm(c.TokenID)),
		ast.Item(keyVM, ast.StringTerm(c.VM)),
	)
}

func stringsTerm(ss []string) *ast.Term {
	ts := make([]*ast.Term, len(ss))
	for i, s := range ss {
		ts[i] = ast.StringTerm(s)
	}
	return ast.ArrayTerm(ts...)
}

// CleanPath puts a guest path in the one form rules compare: absolute,
// lexically clean (no "..", "//", "." or trailing slash), valid UTF-8, no
// NUL. ".." above the root stays at the root, as the kernel resolves it.
// Symlinks cannot be resolved here; the guest enforces its roots again on
// the resolved path.
func CleanPath(p string) (string, error) {
	if !strings.HasPrefix(p, "/") {
		return "", fmt.Errorf("%w: path %q is not absolute", ErrInvalidInput, p)
	}
	if len(p) > MaxPathBytes {
		return "", fmt.Errorf("%w: path of %d bytes, limit %d", ErrInvalidInput, len(p), MaxPathBytes)
	}
	if err := checkStrings("path", p); err != nil {
		return "", err
	}
	return path.Clean(p), nil
}

// checkStrings refuses what no rule should have to think about: invalid
// UTF-8, NUL, and oversized strings.
func checkStrings(what string, ss ...string) error {
	for _, s := range ss {
		if len(s) > MaxStringBytes {
			return fmt.Errorf("%w: %s: a string of %d bytes, limit %d", ErrInvalidInput, what, len(s), MaxStringBytes)
		}
		if !utf8.ValidString(s) {
			return fmt.Errorf("%w: %s: %q is not valid UTF-8", ErrInvalidInput, what, s)
		}
		if strings.IndexByte(s, 0) >= 0 {
			return fmt.Errorf("%w: %s: %q contains NUL", ErrInvalidInput, what, s)
		}
	}
	return nil
}

// NewInput returns an empty input of kind, for decoding into.
func NewInput(k Kind) (Input, error) {
	switch k {
	case KindAPI:
		return &APIInput{}, nil
	case KindExec:
		return &ExecInput{}, nil
	case KindFS:
		return &FSInput{}, nil
	case KindNet:
		return &NetInput{}, nil
	case KindGuest:
		return &GuestInput{}, nil
	}
	return nil, fmt.Errorf("%w: kind %q (want api, exec, fs, net or guest)", ErrInvalidInput, k)
}
