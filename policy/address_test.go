package policy

import (
	"context"
	"encoding/json"
	"errors"
	"net/netip"
	"reflect"
	"testing"
)

func TestAddressClass(t *testing.T) {
	for ip, want := range map[string]string{
		"8.8.8.8":                ClassPublic,
		"151.101.0.223":          ClassPublic,
		"2a04:4e42::223":         ClassPublic,
		"10.0.0.1":               ClassPrivate,
		"172.16.0.1":             ClassPrivate,
		"172.31.255.255":         ClassPrivate,
		"172.32.0.1":             ClassPublic,
		"192.168.1.1":            ClassPrivate,
		"fd12:3456::1":           ClassPrivate,
		"fc00::1":                ClassPrivate,
		"127.0.0.1":              ClassLoopback,
		"127.255.0.9":            ClassLoopback,
		"::1":                    ClassLoopback,
		"169.254.1.1":            ClassLinkLocal,
		"fe80::1":                ClassLinkLocal,
		"100.64.0.1":             ClassCGNAT,
		"100.127.255.254":        ClassCGNAT,
		"100.128.0.1":            ClassPublic,
		"0.0.0.0":                ClassUnspecified,
		"0.1.2.3":                ClassUnspecified,
		"::":                     ClassUnspecified,
		"224.0.0.1":              ClassMulticast,
		"239.255.255.250":        ClassMulticast,
		"ff02::1":                ClassMulticast,
		"169.254.169.254":        ClassMetadata,
		"fd00:ec2::254":          ClassMetadata,
		"255.255.255.255":        ClassReserved,
		"240.0.0.1":              ClassReserved,
		"192.0.2.7":              ClassReserved,
		"2001:db8::1":            ClassReserved,
		"::ffff:10.0.0.1":        ClassPrivate,
		"::ffff:169.254.169.254": ClassMetadata,
		"::ffff:8.8.8.8":         ClassPublic,
		"64:ff9b::a00:1":         ClassPrivate, // NAT64 of 10.0.0.1
		"64:ff9b::7f00:1":        ClassLoopback,
		"64:ff9b::808:808":       ClassPublic,
		"::10.0.0.1":             ClassReserved,
	} {
		if got := AddressClass(netip.MustParseAddr(ip)); got != want {
			t.Errorf("AddressClass(%s) = %s, want %s", ip, got, want)
		}
	}
	if got := AddressClass(netip.Addr{}); got != ClassReserved {
		t.Errorf("AddressClass(invalid) = %s", got)
	}
	if got := AddressClass(netip.MustParseAddr("fe80::1%eth0")); got != ClassReserved {
		t.Errorf("AddressClass(with a zone) = %s", got)
	}
}

func TestNetInputAddresses(t *testing.T) {
	cases := []struct {
		src  string
		want *NetInput
	}{
		// A literal gets its one address, whatever the caller said.
		{`{"vm":"d","direction":"egress","host":"10.0.0.1","port":443,"addresses":[{"ip":"8.8.8.8","class":"public"}]}`,
			&NetInput{VM: "d", Direction: DirEgress, Host: "10.0.0.1", Port: 443, Protocol: "tcp", IPLiteral: true,
				Addresses: []NetAddress{{IP: "10.0.0.1", Class: ClassPrivate}}}},
		{`{"vm":"d","direction":"egress","host":"::FFFF:169.254.169.254","port":80}`,
			&NetInput{VM: "d", Direction: DirEgress, Host: "169.254.169.254", Port: 80, Protocol: "tcp", IPLiteral: true,
				Addresses: []NetAddress{{IP: "169.254.169.254", Class: ClassMetadata}}}},
		{`{"vm":"d","direction":"egress","host":"0:0::1","port":80,"ip_literal":false}`,
			&NetInput{VM: "d", Direction: DirEgress, Host: "::1", Port: 80, Protocol: "tcp", IPLiteral: true,
				Addresses: []NetAddress{{IP: "::1", Class: ClassLoopback}}}},
		// A name: classes are computed, repeats dropped, ip_literal never taken from the caller.
		{`{"vm":"d","direction":"egress","host":"a.test","port":443,"ip_literal":true,"addresses":[{"ip":"127.0.0.1","class":"public"},{"ip":"::ffff:127.0.0.1"},{"ip":"2A04:4E42::223"}]}`,
			&NetInput{VM: "d", Direction: DirEgress, Host: "a.test", Port: 443, Protocol: "tcp",
				Addresses: []NetAddress{{IP: "127.0.0.1", Class: ClassLoopback}, {IP: "2a04:4e42::223", Class: ClassPublic}}}},
		{`{"vm":"d","direction":"egress","host":"a.test","port":443,"addresses":[]}`,
			&NetInput{VM: "d", Direction: DirEgress, Host: "a.test", Port: 443, Protocol: "tcp"}},
		// Forward inputs are as they were.
		{`{"vm":"d","direction":"forward","host":"127.0.0.1","port":8080}`,
			&NetInput{VM: "d", Direction: DirForward, Host: "127.0.0.1", Port: 8080, Protocol: "tcp"}},
	}
	for _, c := range cases {
		got, err := DecodeInput(KindNet, []byte(c.src))
		if err != nil {
			t.Errorf("DecodeInput(%s): %v", c.src, err)
			continue
		}
		if !reflect.DeepEqual(got, c.want) {
			t.Errorf("DecodeInput(%s) =\n%+v, want\n%+v", c.src, got, c.want)
		}
		// The canonical form decodes to itself.
		canon, _ := json.Marshal(got)
		again, err := DecodeInput(KindNet, canon)
		if err != nil || !reflect.DeepEqual(again, got) {
			t.Errorf("canonical %s decodes to %+v, %v", canon, again, err)
		}
	}
	many := `{"direction":"egress","host":"a.test","port":1,"addresses":[`
	for i := range MaxNetAddresses + 1 {
		if i > 0 {
			many += ","
		}
		many += `{"ip":"10.0.0.` + string(rune('0'+i%10)) + `"}`
	}
	many += `]}`
	for _, src := range []string{
		`{"direction":"egress","host":"a.test","port":443,"addresses":[{"ip":"not an ip"}]}`,
		`{"direction":"egress","host":"a.test","port":443,"addresses":[{"ip":"fe80::1%eth0"}]}`,
		`{"direction":"egress","host":"a.test","port":443,"addresses":[{"ip":""}]}`,
		`{"direction":"forward","host":"127.0.0.1","port":443,"addresses":[{"ip":"127.0.0.1"}]}`,
		`{"direction":"egress","host":"[::1]","port":443}`,
		`{"direction":"egress","host":"fe80::1%eth0","port":443}`,
		many,
	} {
		if in, err := DecodeInput(KindNet, []byte(src)); !errors.Is(err, ErrInvalidInput) {
			t.Errorf("DecodeInput(%.80s) = %+v, %v; want ErrInvalidInput", src, in, err)
		}
	}
}

// TestEgressDecisions runs the egress rules on inputs as carreld makes
// them: the name first, then with the addresses it resolved.
func TestEgressDecisions(t *testing.T) {
	ctx := context.Background()
	var data map[string]any
	if err := json.Unmarshal(defaultFiles(t)[DataFile], &data); err != nil {
		t.Fatal(err)
	}
	data["settings"].(map[string]any)["net"].(map[string]any)["egress_allow"] = []any{
		map[string]any{"host": "allowed.test", "port": 8443, "networks": []string{"127.0.0.1/32"}},
		map[string]any{"host": "public.test", "port": 443},
	}
	raw, _ := json.Marshal(data)
	b, err := FromFiles(map[string][]byte{DataFile: raw})
	if err != nil {
		t.Fatal(err)
	}
	p, err := Compile(ctx, "egress", b)
	if err != nil {
		t.Fatal(err)
	}
	addrs := func(ips ...string) []NetAddress {
		var out []NetAddress
		for _, ip := range ips {
			out = append(out, NetAddress{IP: ip})
		}
		return out
	}
	for _, c := range []struct {
		host  string
		port  int
		addrs []NetAddress
		allow bool
		rule  string
	}{
		{"allowed.test", 8443, nil, true, "carrel.net.egress_allow"},
		{"allowed.test", 8443, addrs("127.0.0.1"), true, "carrel.net.egress_allow"},
		{"allowed.test", 8443, addrs("127.0.0.2"), false, "carrel.net.address_refused"},
		{"allowed.test", 8443, addrs("::ffff:127.0.0.1"), true, "carrel.net.egress_allow"},
		{"allowed.test", 8444, addrs("127.0.0.1"), false, "carrel.net.default_deny"},
		{"public.test", 443, addrs("93.184.215.14"), true, "carrel.net.egress_allow"},
		{"public.test", 443, addrs("93.184.215.14", "10.0.0.1"), false, "carrel.net.address_refused"},
		{"public.test", 443, addrs("169.254.169.254"), false, "carrel.net.address_refused"},
		{"public.test", 443, addrs("fd00:ec2::254"), false, "carrel.net.address_refused"},
		{"127.0.0.1", 8443, nil, false, "carrel.net.ip_literal"},
		{"93.184.215.14", 443, nil, false, "carrel.net.ip_literal"},
		{"other.test", 443, nil, false, "carrel.net.default_deny"},
	} {
		in := &NetInput{VM: "demo", Direction: DirEgress, Host: c.host, Port: c.port, Addresses: c.addrs}
		d, err := p.Decide(ctx, in)
		if err != nil || d.Allow != c.allow || d.Rule != c.rule {
			t.Errorf("egress %s:%d %v: allow %v by %s (%s), %v; want allow %v by %s", c.host, c.port, c.addrs, d.Allow, d.Rule, d.Reason, err, c.allow, c.rule)
		}
	}
}

func TestNetLimits(t *testing.T) {
	ctx := context.Background()
	l, err := compiledDefault(t).NetLimits(ctx, "demo")
	if err != nil || l != (NetLimits{}) {
		t.Fatalf("default limits: %+v, %v; want none", l, err)
	}
	var data map[string]any
	if err := json.Unmarshal(defaultFiles(t)[DataFile], &data); err != nil {
		t.Fatal(err)
	}
	s := data["settings"].(map[string]any)
	s["net"].(map[string]any)["limits"] = map[string]any{"max_connections": 8, "bandwidth_bytes_per_second": 1 << 20}
	s["vms"] = map[string]any{"slow": map[string]any{"net": map[string]any{"limits": map[string]any{"bandwidth_bytes_per_second": 1024}}}}
	compile := func() (*Policy, error) {
		raw, _ := json.Marshal(data)
		b, err := FromFiles(map[string][]byte{DataFile: raw})
		if err != nil {
			return nil, err
		}
		return Compile(ctx, "limits", b)
	}
	p, err := compile()
	if err != nil {
		t.Fatal(err)
	}
	if l, err := p.NetLimits(ctx, "demo"); err != nil || l != (NetLimits{MaxConnections: 8, BandwidthBytesPerSecond: 1 << 20}) {
		t.Errorf("limits of demo: %+v, %v", l, err)
	}
	if l, err := p.NetLimits(ctx, "slow"); err != nil || l != (NetLimits{MaxConnections: 8, BandwidthBytesPerSecond: 1024}) {
		t.Errorf("limits of slow (an override): %+v, %v", l, err)
	}
	for _, bad := range []any{
		map[string]any{"max_connections": -1},
		map[string]any{"max_connections": 1.5},
		map[string]any{"max_conections": 4},
		"fast",
	} {
		s["net"].(map[string]any)["limits"] = bad
		s["vms"] = map[string]any{}
		p, err := compile()
		if err != nil {
			t.Fatal(err)
		}
		if l, err := p.NetLimits(ctx, "demo"); err == nil {
			t.Errorf("limits %v: %+v, no error", bad, l)
		}
	}
	// A bundle of its own rules without net.limits sets none.
	tb, err := tinyBundle(t, nil)
	if err != nil {
		t.Fatal(err)
	}
	tp, err := Compile(ctx, "tiny", tb)
	if err != nil {
		t.Fatal(err)
	}
	if l, err := tp.NetLimits(ctx, "demo"); err != nil || l != (NetLimits{}) {
		t.Errorf("limits of a bundle without the rule: %+v, %v", l, err)
	}
}
