package policy

import (
	"fmt"
	"net/netip"
	"strings"

	"github.com/open-policy-agent/opa/v1/ast"
)

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
		if err := normalizeCaller(in.Caller); err != nil {
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
		items = append(items, ast.Item(keyCaller, ast.NewTerm(callerValue(in.Caller))))
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
