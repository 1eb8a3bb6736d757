package policy

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"path"
	"strings"
	"unicode/utf8"

	"github.com/open-policy-agent/opa/v1/ast"
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

// An Input is one of the typed input documents below. Normalize checks it
// and puts it in canonical form; Decide calls it before evaluation.
type Input interface {
	Kind() Kind
	Normalize() error
	VMName() string
	value() ast.Value
}

// Caller is who made an API call: a local process (SO_PEERCRED) or the
// holder of a token.
type Caller struct {
	Type string `json:"type"` // "peer" or "token"
	UID  uint32 `json:"uid,omitempty"`
	GID  uint32 `json:"gid,omitempty"`
	PID  int32  `json:"pid,omitempty"`
	// Groups names a peer's primary and supplementary groups.
	Groups  []string `json:"groups,omitempty"`
	TokenID string   `json:"token_id,omitempty"`
	VM      string   `json:"vm,omitempty"` // the VM a token is scoped to
}

const (
	CallerPeer  = "peer"
	CallerToken = "token"
)

// MarshalJSON writes exactly the fields the rules see (value), so that a
// recorded input decodes back to the document that was decided: a root
// peer has "uid": 0, not no uid.
func (c Caller) MarshalJSON() ([]byte, error) {
	switch c.Type {
	case CallerPeer:
		groups := c.Groups
		if groups == nil {
			groups = []string{}
		}
		return json.Marshal(struct {
			Type   string   `json:"type"`
			UID    uint32   `json:"uid"`
			GID    uint32   `json:"gid"`
			PID    int32    `json:"pid"`
			Groups []string `json:"groups"`
		}{c.Type, c.UID, c.GID, c.PID, groups})
	case CallerToken:
		return json.Marshal(struct {
			Type    string `json:"type"`
			TokenID string `json:"token_id"`
			VM      string `json:"vm"`
		}{c.Type, c.TokenID, c.VM})
	}
	return json.Marshal(struct {
		Type string `json:"type"`
	}{c.Type})
}

func (c Caller) normalize() error {
	switch c.Type {
	case CallerPeer, CallerToken:
	default:
		return fmt.Errorf("%w: caller type %q", ErrInvalidInput, c.Type)
	}
	if len(c.Groups) > 256 {
		return fmt.Errorf("%w: caller in %d groups, limit 256", ErrInvalidInput, len(c.Groups))
	}
	if err := checkStrings("caller groups", c.Groups...); err != nil {
		return err
	}
	return checkStrings("caller", c.TokenID, c.VM)
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

	versionTerm = ast.IntNumberTerm(InputVersion)
	fixedTerms  = func() map[string]*ast.Term {
		m := map[string]*ast.Term{}
		for _, s := range []string{CallerPeer, CallerToken, OpRead, OpWrite, OpCreate, OpDelete, OpChmod, OpList, OpWatch,
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

func (c Caller) value() ast.Value {
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
	return ast.NewObject(
		ast.Item(keyType, stringTerm(c.Type)),
		ast.Item(keyTokenID, ast.StringTerm(c.TokenID)),
		ast.Item(keyVM, ast.StringTerm(c.VM)),
	)
}

// APIInput asks whether caller may call procedure (on vm, if it names one).
type APIInput struct {
	Caller    Caller `json:"caller"`
	DaemonUID uint32 `json:"daemon_uid"`
	Procedure string `json:"procedure"`
	VM        string `json:"vm"`
	// GPUs are the PCI addresses of the GPUs the call would give vm:
	// CreateVM's, or the ones a VM that StartVM boots was created with.
	// Normalize writes them in the kernel's spelling, sorted.
	GPUs []string `json:"gpus,omitempty"`
}

func (*APIInput) Kind() Kind        { return KindAPI }
func (in *APIInput) VMName() string { return in.VM }

func (in *APIInput) Normalize() error {
	if err := in.Caller.normalize(); err != nil {
		return err
	}
	if !strings.HasPrefix(in.Procedure, "/") {
		return fmt.Errorf("%w: procedure %q", ErrInvalidInput, in.Procedure)
	}
	gpus, err := normalizeGPUs(in.GPUs)
	if err != nil {
		return err
	}
	in.GPUs = gpus
	return checkStrings("api", in.Procedure, in.VM)
}

func (in *APIInput) value() ast.Value {
	caller := ast.NewTerm(in.Caller.value())
	if len(in.GPUs) == 0 { // as in the JSON: gpus only when set
		return ast.NewObject(
			ast.Item(keyVersion, versionTerm),
			ast.Item(keyCaller, caller),
			ast.Item(keyDaemonUID, ast.InternedTerm(in.DaemonUID)),
			ast.Item(keyProcedure, ast.StringTerm(in.Procedure)),
			ast.Item(keyVM, ast.StringTerm(in.VM)),
		)
	}
	gpus := make([]*ast.Term, len(in.GPUs))
	for i, g := range in.GPUs {
		gpus[i] = ast.StringTerm(g)
	}
	return ast.NewObject(
		ast.Item(keyVersion, versionTerm),
		ast.Item(keyCaller, caller),
		ast.Item(keyDaemonUID, ast.InternedTerm(in.DaemonUID)),
		ast.Item(keyProcedure, ast.StringTerm(in.Procedure)),
		ast.Item(keyVM, ast.StringTerm(in.VM)),
		ast.Item(keyGPUs, ast.ArrayTerm(gpus...)),
	)
}

// ExecInput asks whether a command may start in a VM.
type ExecInput struct {
	Caller Caller            `json:"caller"`
	VM     string            `json:"vm"`
	Argv   []string          `json:"argv"`
	Env    map[string]string `json:"env"`
	Cwd    string            `json:"cwd"`
	User   string            `json:"user"`
	TTY    bool              `json:"tty"`
}

// Defaults the guest applies, filled in so that rules see what will run.
const (
	DefaultUser = "agent"
	DefaultCwd  = "/workspace"
)

func (*ExecInput) Kind() Kind        { return KindExec }
func (in *ExecInput) VMName() string { return in.VM }

func (in *ExecInput) Normalize() error {
	if err := in.Caller.normalize(); err != nil {
		return err
	}
	if len(in.Argv) == 0 {
		return fmt.Errorf("%w: empty argv", ErrInvalidInput)
	}
	if len(in.Argv) > MaxArgs || len(in.Env) > MaxEnv {
		return fmt.Errorf("%w: %d arguments and %d environment variables, limits %d and %d", ErrInvalidInput, len(in.Argv), len(in.Env), MaxArgs, MaxEnv)
	}
	if in.User == "" {
		in.User = DefaultUser
	}
	if in.Cwd == "" {
		in.Cwd = DefaultCwd
	}
	cwd, err := CleanPath(in.Cwd)
	if err != nil {
		return err
	}
	in.Cwd = cwd
	total := 0
	for _, a := range in.Argv {
		total += len(a)
	}
	for k, v := range in.Env {
		total += len(k) + len(v)
		if k == "" || strings.ContainsRune(k, '=') {
			return fmt.Errorf("%w: environment name %q", ErrInvalidInput, k)
		}
		if err := checkStrings("env", k, v); err != nil {
			return err
		}
	}
	if total > MaxInputBytes {
		return fmt.Errorf("%w: %d bytes of arguments and environment, limit %d", ErrInvalidInput, total, MaxInputBytes)
	}
	if err := checkStrings("argv", in.Argv...); err != nil {
		return err
	}
	return checkStrings("exec", in.VM, in.User)
}

func (in *ExecInput) value() ast.Value {
	argv := make([]*ast.Term, len(in.Argv))
	for i, a := range in.Argv {
		argv[i] = ast.StringTerm(a)
	}
	env := make([][2]*ast.Term, 0, len(in.Env))
	for k, v := range in.Env {
		env = append(env, ast.Item(ast.StringTerm(k), ast.StringTerm(v)))
	}
	return ast.NewObject(
		ast.Item(keyVersion, versionTerm),
		ast.Item(keyCaller, ast.NewTerm(in.Caller.value())),
		ast.Item(keyVM, ast.StringTerm(in.VM)),
		ast.Item(keyArgv, ast.ArrayTerm(argv...)),
		ast.Item(keyEnv, ast.NewTerm(ast.NewObject(env...))),
		ast.Item(keyCwd, stringTerm(in.Cwd)),
		ast.Item(keyUser, stringTerm(in.User)),
		ast.Item(keyTTY, ast.InternedTerm(in.TTY)),
	)
}

// File operations, as the fs package sees them.
const (
	OpRead   = "read"
	OpWrite  = "write"
	OpCreate = "create"
	OpDelete = "delete"
	OpChmod  = "chmod"
	OpList   = "list"
	OpWatch  = "watch"
)

var fsOps = map[string]bool{OpRead: true, OpWrite: true, OpCreate: true, OpDelete: true, OpChmod: true, OpList: true, OpWatch: true}

// FSInput asks whether an operation on a path in a VM may go ahead.
type FSInput struct {
	Caller    Caller `json:"caller"`
	VM        string `json:"vm"`
	Operation string `json:"operation"`
	Path      string `json:"path"`
	Recursive bool   `json:"recursive"`
}

func (*FSInput) Kind() Kind        { return KindFS }
func (in *FSInput) VMName() string { return in.VM }

func (in *FSInput) Normalize() error {
	if err := in.Caller.normalize(); err != nil {
		return err
	}
	if !fsOps[in.Operation] {
		return fmt.Errorf("%w: file operation %q", ErrInvalidInput, in.Operation)
	}
	p, err := CleanPath(in.Path)
	if err != nil {
		return err
	}
	in.Path = p
	return checkStrings("fs", in.VM)
}

func (in *FSInput) value() ast.Value {
	return ast.NewObject(
		ast.Item(keyVersion, versionTerm),
		ast.Item(keyCaller, ast.NewTerm(in.Caller.value())),
		ast.Item(keyVM, ast.StringTerm(in.VM)),
		ast.Item(keyOperation, stringTerm(in.Operation)),
		ast.Item(keyPath, ast.StringTerm(in.Path)),
		ast.Item(keyRecursive, ast.InternedTerm(in.Recursive)),
	)
}

// Directions of a network connection.
const (
	DirEgress  = "egress"  // the VM reaching out, through the host
	DirForward = "forward" // a host-side client reaching a port in the VM
)

// NetInput asks whether a connection may be made.
type NetInput struct {
	Caller    Caller `json:"caller"`
	VM        string `json:"vm"`
	Direction string `json:"direction"`
	Host      string `json:"host"`
	Port      int    `json:"port"`
	Protocol  string `json:"protocol"`
	// IPLiteral is set by Normalize for egress to an IP address rather
	// than a name; it is never taken from the caller.
	IPLiteral bool `json:"ip_literal,omitempty"`
	// Addresses are what an egress host resolved to, each with the class
	// Normalize gives it (AddressClass). carreld asks first with none,
	// before it resolves the name (so a denied name never reaches DNS),
	// then again with them. For an IP literal, Normalize sets the one
	// address.
	Addresses []NetAddress `json:"addresses,omitempty"`
}

// NetAddress is one address an egress host resolved to.
type NetAddress struct {
	IP    string `json:"ip"`
	Class string `json:"class"`
}

// MaxNetAddresses caps the addresses a net input carries.
const MaxNetAddresses = 32

func (*NetInput) Kind() Kind        { return KindNet }
func (in *NetInput) VMName() string { return in.VM }

func (in *NetInput) Normalize() error {
	if in.Caller.Type != "" { // egress has no API caller: the guest asks
		if err := in.Caller.normalize(); err != nil {
			return err
		}
	}
	if in.Direction != DirEgress && in.Direction != DirForward {
		return fmt.Errorf("%w: direction %q", ErrInvalidInput, in.Direction)
	}
	if in.Port < 1 || in.Port > 65535 {
		return fmt.Errorf("%w: port %d", ErrInvalidInput, in.Port)
	}
	if in.Protocol == "" {
		in.Protocol = "tcp"
	}
	if in.Protocol != "tcp" && in.Protocol != "udp" {
		return fmt.Errorf("%w: protocol %q", ErrInvalidInput, in.Protocol)
	}
	h, err := normalizeHost(in.Host)
	if err != nil {
		return err
	}
	in.Host = h
	if err := in.normalizeAddresses(); err != nil {
		return err
	}
	return checkStrings("net", in.VM)
}

// normalizeAddresses writes an IP literal host, and every address, in
// their canonical form (an IPv4-mapped address as IPv4), drops repeats,
// and classes each address itself: a class the caller gave is replaced.
func (in *NetInput) normalizeAddresses() error {
	in.IPLiteral = false
	if in.Direction != DirEgress {
		if len(in.Addresses) > 0 {
			return fmt.Errorf("%w: addresses are for egress only", ErrInvalidInput)
		}
		return nil
	}
	if len(in.Addresses) > MaxNetAddresses {
		return fmt.Errorf("%w: %d addresses, limit %d", ErrInvalidInput, len(in.Addresses), MaxNetAddresses)
	}
	if a, err := netip.ParseAddr(in.Host); err == nil {
		a = a.Unmap()
		in.Host, in.IPLiteral = a.String(), true
		in.Addresses = []NetAddress{{IP: in.Host, Class: AddressClass(a)}}
		return nil
	}
	seen := make(map[netip.Addr]bool, len(in.Addresses))
	out := in.Addresses[:0:0]
	for _, na := range in.Addresses {
		a, err := netip.ParseAddr(na.IP)
		if err != nil || a.Zone() != "" {
			return fmt.Errorf("%w: address %.64q", ErrInvalidInput, na.IP)
		}
		a = a.Unmap()
		if seen[a] {
			continue
		}
		seen[a] = true
		out = append(out, NetAddress{IP: a.String(), Class: AddressClass(a)})
	}
	in.Addresses = out
	if len(out) == 0 {
		in.Addresses = nil
	}
	return nil
}

// normalizeHost puts a host name or IP literal in the one form rules
// compare: ASCII only (checked before case folding, since Unicode folding
// turns the Kelvin sign into "k"), lower case, no root dot, no empty
// labels. "Example.COM." cannot slip past a rule about "example.com".
func normalizeHost(host string) (string, error) {
	if host == "" || len(host) > 254 {
		return "", fmt.Errorf("%w: host %q", ErrInvalidInput, host)
	}
	for i := 0; i < len(host); i++ {
		c := host[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '-' || c == ':' || c == '_') {
			return "", fmt.Errorf("%w: host %q has a character outside [A-Za-z0-9.-:_]", ErrInvalidInput, host)
		}
	}
	h := strings.TrimSuffix(strings.ToLower(host), ".")
	if len(h) > 253 {
		return "", fmt.Errorf("%w: host name of %d bytes, limit 253", ErrInvalidInput, len(h))
	}
	if h == "" || strings.HasPrefix(h, ".") || strings.Contains(h, "..") || strings.HasSuffix(h, ".") {
		return "", fmt.Errorf("%w: host %q has an empty label", ErrInvalidInput, host)
	}
	return h, nil
}

func (in *NetInput) value() ast.Value {
	items := make([][2]*ast.Term, 6, 9)
	items[0] = ast.Item(keyVersion, versionTerm)
	items[1] = ast.Item(keyVM, ast.StringTerm(in.VM))
	items[2] = ast.Item(keyDirection, stringTerm(in.Direction))
	items[3] = ast.Item(keyHost, ast.StringTerm(in.Host))
	items[4] = ast.Item(keyPort, ast.InternedTerm(in.Port))
	items[5] = ast.Item(keyProtocol, stringTerm(in.Protocol))
	if in.Caller.Type != "" { // egress has none: the guest asks
		items = append(items, ast.Item(keyCaller, ast.NewTerm(in.Caller.value())))
	}
	// As in the JSON: each only when set.
	if in.IPLiteral {
		items = append(items, ast.Item(keyIPLiteral, ast.InternedTerm(true)))
	}
	if len(in.Addresses) > 0 {
		addrs := make([]*ast.Term, len(in.Addresses))
		for i, a := range in.Addresses {
			addrs[i] = ast.ObjectTerm(ast.Item(keyIP, ast.StringTerm(a.IP)), ast.Item(keyClass, stringTerm(a.Class)))
		}
		items = append(items, ast.Item(keyAddresses, ast.ArrayTerm(addrs...)))
	}
	return ast.NewObject(items...)
}

// GuestInput asks whether the agent inside a VM may have what it asked
// its host for.
type GuestInput struct {
	VM      string            `json:"vm"`
	Request string            `json:"request"`
	Args    map[string]string `json:"args"`
}

func (*GuestInput) Kind() Kind        { return KindGuest }
func (in *GuestInput) VMName() string { return in.VM }

func (in *GuestInput) Normalize() error {
	if in.Request == "" {
		return fmt.Errorf("%w: empty guest request", ErrInvalidInput)
	}
	if len(in.Args) > 64 {
		return fmt.Errorf("%w: %d guest request arguments, limit 64", ErrInvalidInput, len(in.Args))
	}
	for k, v := range in.Args {
		if err := checkStrings("guest", k, v); err != nil {
			return err
		}
	}
	return checkStrings("guest", in.VM, in.Request)
}

func (in *GuestInput) value() ast.Value {
	args := make([][2]*ast.Term, 0, len(in.Args))
	for k, v := range in.Args {
		args = append(args, ast.Item(ast.StringTerm(k), ast.StringTerm(v)))
	}
	return ast.NewObject(
		ast.Item(keyVersion, versionTerm),
		ast.Item(keyVM, ast.StringTerm(in.VM)),
		ast.Item(keyRequest, ast.StringTerm(in.Request)),
		ast.Item(keyArgs, ast.NewTerm(ast.NewObject(args...))),
	)
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
