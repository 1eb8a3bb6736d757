package egress

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
)

// Resolver turns a host name into addresses. *net.Resolver is one; Hosts
// is another.
type Resolver interface {
	LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error)
}

var (
	_ Resolver = (*net.Resolver)(nil)
	_ Resolver = Hosts(nil)
)

// Hosts is a fixed map from names (lower case, without a trailing dot) to
// addresses, used instead of DNS: for tests, and for sites with no
// resolver of their own. A name it lacks does not resolve.
type Hosts map[string][]netip.Addr

// LookupNetIP returns name's addresses of network's family ("ip", "ip4"
// or "ip6").
func (h Hosts) LookupNetIP(_ context.Context, network, host string) ([]netip.Addr, error) {
	var out []netip.Addr
	for _, a := range h[strings.TrimSuffix(strings.ToLower(host), ".")] {
		if network == "ip" || network == "ip4" && a.Is4() || network == "ip6" && a.Is6() {
			out = append(out, a)
		}
	}
	if len(out) == 0 {
		return nil, &net.DNSError{Err: "no such host in the egress hosts file", Name: host, IsNotFound: true}
	}
	return out, nil
}

// maxHostsBytes caps a hosts file.
const maxHostsBytes = 4 << 20

// LoadHosts reads a file in hosts(5) format: an address, then one or
// more names, per line; '#' starts a comment. A name on several lines gets
// every address, in order.
func LoadHosts(path string) (Hosts, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("egress hosts: %w", err)
	}
	defer f.Close()
	h, err := ParseHosts(io.LimitReader(f, maxHostsBytes+1))
	if err != nil {
		return nil, fmt.Errorf("egress hosts %s: %w", path, err)
	}
	return h, nil
}

// ParseHosts reads hosts(5) text; see LoadHosts.
func ParseHosts(r io.Reader) (Hosts, error) {
	h := Hosts{}
	sc := bufio.NewScanner(r)
	total := 0
	for n := 1; sc.Scan(); n++ {
		total += len(sc.Bytes()) + 1
		if total > maxHostsBytes {
			return nil, fmt.Errorf("over %d bytes", maxHostsBytes)
		}
		line, _, _ := strings.Cut(sc.Text(), "#")
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		a, err := netip.ParseAddr(f[0])
		if err != nil || a.Zone() != "" {
			return nil, fmt.Errorf("line %d: %q is not an IP address", n, f[0])
		}
		if len(f) < 2 {
			return nil, fmt.Errorf("line %d: %s names no host", n, f[0])
		}
		for _, name := range f[1:] {
			name = strings.TrimSuffix(strings.ToLower(name), ".")
			h[name] = append(h[name], a.Unmap())
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return h, nil
}
