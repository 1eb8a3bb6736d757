package policy

import "net/netip"

// Classes of an IP address, as net inputs carry them. Every class but
// ClassPublic is refused for egress unless the policy names the address.
const (
	ClassPublic      = "public"
	ClassPrivate     = "private"     // RFC 1918, fc00::/7, NAT64 local-use
	ClassLoopback    = "loopback"    // 127/8, ::1
	ClassLinkLocal   = "link_local"  // 169.254/16, fe80::/10
	ClassCGNAT       = "cgnat"       // 100.64/10
	ClassUnspecified = "unspecified" // 0/8, ::
	ClassMulticast   = "multicast"   // 224/4, ff00::/8
	ClassMetadata    = "metadata"    // cloud instance metadata: 169.254.169.254, fd00:ec2::254
	ClassReserved    = "reserved"    // documentation, benchmarking, 240/4, broadcast, ...
)

type prefixClass struct {
	prefix netip.Prefix
	class  string
}

// v4Classes and v6Classes are checked in order: the first prefix that
// holds the address names its class (so the metadata hosts come before the
// ranges that hold them).
var (
	v4Classes = []prefixClass{
		{netip.MustParsePrefix("169.254.169.254/32"), ClassMetadata},
		{netip.MustParsePrefix("0.0.0.0/8"), ClassUnspecified},
		{netip.MustParsePrefix("10.0.0.0/8"), ClassPrivate},
		{netip.MustParsePrefix("100.64.0.0/10"), ClassCGNAT},
		{netip.MustParsePrefix("127.0.0.0/8"), ClassLoopback},
		{netip.MustParsePrefix("169.254.0.0/16"), ClassLinkLocal},
		{netip.MustParsePrefix("172.16.0.0/12"), ClassPrivate},
		{netip.MustParsePrefix("192.0.0.0/24"), ClassReserved},
		{netip.MustParsePrefix("192.0.2.0/24"), ClassReserved},
		{netip.MustParsePrefix("192.168.0.0/16"), ClassPrivate},
		{netip.MustParsePrefix("198.18.0.0/15"), ClassReserved},
		{netip.MustParsePrefix("198.51.100.0/24"), ClassReserved},
		{netip.MustParsePrefix("203.0.113.0/24"), ClassReserved},
		{netip.MustParsePrefix("224.0.0.0/4"), ClassMulticast},
		{netip.MustParsePrefix("240.0.0.0/4"), ClassReserved}, // and 255.255.255.255
	}
	v6Classes = []prefixClass{
		{netip.MustParsePrefix("fd00:ec2::254/128"), ClassMetadata},
		{netip.MustParsePrefix("::/128"), ClassUnspecified},
		{netip.MustParsePrefix("::1/128"), ClassLoopback},
		{netip.MustParsePrefix("::/96"), ClassReserved}, // IPv4-compatible, deprecated
		{netip.MustParsePrefix("64:ff9b:1::/48"), ClassPrivate},
		{netip.MustParsePrefix("100::/64"), ClassReserved},
		{netip.MustParsePrefix("2001:db8::/32"), ClassReserved},
		{netip.MustParsePrefix("fc00::/7"), ClassPrivate},
		{netip.MustParsePrefix("fe80::/10"), ClassLinkLocal},
		{netip.MustParsePrefix("fec0::/10"), ClassReserved}, // site-local, deprecated
		{netip.MustParsePrefix("ff00::/8"), ClassMulticast},
	}
	nat64 = netip.MustParsePrefix("64:ff9b::/96")
)

// AddressClass classifies a: an IPv4-mapped IPv6 address, or one in the
// NAT64 prefix 64:ff9b::/96, is classed as the IPv4 address it carries, so
// that ::ffff:10.0.0.1 is as private as 10.0.0.1. An invalid address, or
// one with a zone, is ClassReserved.
func AddressClass(a netip.Addr) string {
	if !a.IsValid() || a.Zone() != "" {
		return ClassReserved
	}
	a = a.Unmap()
	if a.Is6() && nat64.Contains(a) {
		b := a.As16()
		a = netip.AddrFrom4([4]byte(b[12:16]))
	}
	classes := v6Classes
	if a.Is4() {
		classes = v4Classes
	}
	for _, c := range classes {
		if c.prefix.Contains(a) {
			return c.class
		}
	}
	return ClassPublic
}
