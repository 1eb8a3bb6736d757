package carrel.net_test

import data.carrel.net

net_input(direction, host, port) := {
	"version": 1,
	"vm": "demo",
	"direction": direction,
	"host": host,
	"port": port,
	"protocol": "tcp",
}

decide(direction, host, port) := d if {
	d := net.decision with input as net_input(direction, host, port)
}

allowed_by(d, rule) if {
	d.allow == true
	d.rule == rule
}

denied_by(d, rule) if {
	d.allow == false
	d.rule == rule
}

allow_list := [
	{"host": "pypi.org", "port": 443},
	{"host": "*.github.com", "port": 443},
	{"host": "dns.example", "port": 53, "protocol": "udp"},
]

test_egress_denied_by_default if {
	d := decide("egress", "registry.npmjs.org", 443)
	denied_by(d, "carrel.net.default_deny")
	d.reason == "egress to registry.npmjs.org:443/tcp: not in settings.net.egress_allow"
}

test_forward_allowed_by_default if {
	d := decide("forward", "localhost", 8080)
	allowed_by(d, "carrel.net.forward")
	d.reason == "forward to port 8080: settings.net.allow_forward is true"
}

test_forward_denied_when_off if {
	d := decide("forward", "localhost", 8080) with data.settings.net.allow_forward as false
	denied_by(d, "carrel.net.default_deny")
	d.reason == "forward to port 8080: settings.net.allow_forward is not true"
}

test_exact_host_allowed if {
	d := decide("egress", "pypi.org", 443) with data.settings.net.egress_allow as allow_list
	allowed_by(d, "carrel.net.egress_allow")
	d.reason == "egress to pypi.org:443/tcp: allowed by pypi.org:443 in settings.net.egress_allow"
}

test_exact_host_needs_its_port if {
	denied_by(decide("egress", "pypi.org", 80), "carrel.net.default_deny") with data.settings.net.egress_allow as allow_list
}

test_exact_host_matches_whole_name if {
	every host in ["evilpypi.org", "pypi.org.evil.com", "www.pypi.org", "pypi.or"] {
		denied_by(decide("egress", host, 443), "carrel.net.default_deny") with data.settings.net.egress_allow as allow_list
	}
}

test_wildcard_matches_names_below if {
	every host in ["api.github.com", "codeload.github.com", "a.b.github.com"] {
		allowed_by(decide("egress", host, 443), "carrel.net.egress_allow") with data.settings.net.egress_allow as allow_list
	}
}

test_wildcard_does_not_match_itself_or_lookalikes if {
	every host in ["github.com", "evilgithub.com", "github.com.evil.net", "api.github.co"] {
		denied_by(decide("egress", host, 443), "carrel.net.default_deny") with data.settings.net.egress_allow as allow_list
	}
}

test_protocol_defaults_to_tcp if {
	udp := net.decision with input as object.union(net_input("egress", "pypi.org", 443), {"protocol": "udp"})
		with data.settings.net.egress_allow as allow_list
	denied_by(udp, "carrel.net.default_deny")
	dns := net.decision with input as object.union(net_input("egress", "dns.example", 53), {"protocol": "udp"})
		with data.settings.net.egress_allow as allow_list
	allowed_by(dns, "carrel.net.egress_allow")
	denied_by(decide("egress", "dns.example", 53), "carrel.net.default_deny") with data.settings.net.egress_allow as allow_list
}

test_several_matching_entries_named if {
	entries := [{"host": "api.github.com", "port": 443}, {"host": "*.github.com", "port": 443}]
	d := decide("egress", "api.github.com", 443) with data.settings.net.egress_allow as entries
	allowed_by(d, "carrel.net.egress_allow")
	d.reason == "egress to api.github.com:443/tcp: allowed by *.github.com:443, api.github.com:443 in settings.net.egress_allow"
}

test_egress_list_does_not_allow_forward if {
	denied_by(decide("forward", "pypi.org", 443), "carrel.net.default_deny") with data.settings.net.egress_allow as allow_list
		with data.settings.net.allow_forward as false
}

test_unknown_direction_denied if {
	d := decide("ingress", "pypi.org", 443) with data.settings.net.egress_allow as allow_list
	denied_by(d, "carrel.net.default_deny")
	d.reason == "unknown direction ingress"
}

test_vm_override if {
	overrides := {"builder": {"net": {"egress_allow": [{"host": "proxy.golang.org", "port": 443}]}}}
	builder := net.decision with input as object.union(net_input("egress", "proxy.golang.org", 443), {"vm": "builder"})
		with data.settings.vms as overrides
	allowed_by(builder, "carrel.net.egress_allow")
	denied_by(decide("egress", "proxy.golang.org", 443), "carrel.net.default_deny") with data.settings.vms as overrides
}

test_vm_override_turns_forward_off if {
	overrides := {"demo": {"net": {"allow_forward": false}}}
	denied_by(decide("forward", "localhost", 22), "carrel.net.default_deny") with data.settings.vms as overrides
}

test_decision_defined_for_any_input if {
	every doc in [{}, {"direction": "egress"}, {"direction": "forward"}, {"direction": "egress", "host": "pypi.org"}] {
		d := net.decision with input as doc with data.settings.net.egress_allow as allow_list
		d.allow == false
		d.rule == "carrel.net.default_deny"
	}
}

# Egress with what carreld adds: ip_literal and the resolved addresses.
egress_with(host, port, extra) := d if {
	d := net.decision with input as object.union(net_input("egress", host, port), extra)
}

local_list := [
	{"host": "allowed.test", "port": 8443, "networks": ["127.0.0.0/8", "::1/128"]},
	{"host": "pypi.org", "port": 443},
	{"host": "*.corp.example", "port": 443, "networks": ["10.0.0.0/8"]},
	{"host": "10.1.2.3", "port": 5432},
	{"host": "169.254.169.254", "port": 80},
]

test_public_addresses_allowed if {
	d := egress_with("pypi.org", 443, {"addresses": [{"ip": "151.101.0.223", "class": "public"}, {"ip": "2a04:4e42::223", "class": "public"}]})
		with data.settings.net.egress_allow as local_list
	allowed_by(d, "carrel.net.egress_allow")
	d.reason == "egress to pypi.org:443/tcp: allowed by pypi.org:443 in settings.net.egress_allow (addresses 151.101.0.223 public, 2a04:4e42::223 public)"
}

test_private_address_refused_unless_named if {
	every class in ["private", "loopback", "link_local", "cgnat", "unspecified", "multicast", "metadata", "reserved"] {
		d := egress_with("pypi.org", 443, {"addresses": [{"ip": "10.0.0.7", "class": class}]}) with data.settings.net.egress_allow as local_list
		denied_by(d, "carrel.net.address_refused")
		d.reason == sprintf("egress to pypi.org:443/tcp: 10.0.0.7 is %v, and no entry that allows the host names it in its networks", [class])
	}
}

test_one_private_address_among_public_refuses_all if {
	d := egress_with("pypi.org", 443, {"addresses": [{"ip": "151.101.0.223", "class": "public"}, {"ip": "127.0.0.1", "class": "loopback"}]})
		with data.settings.net.egress_allow as local_list
	denied_by(d, "carrel.net.address_refused")
}

test_named_network_allows_private_address if {
	d := egress_with("allowed.test", 8443, {"addresses": [{"ip": "127.0.0.1", "class": "loopback"}, {"ip": "::1", "class": "loopback"}]})
		with data.settings.net.egress_allow as local_list
	allowed_by(d, "carrel.net.egress_allow")
	w := egress_with("git.corp.example", 443, {"addresses": [{"ip": "10.9.8.7", "class": "private"}]}) with data.settings.net.egress_allow as local_list
	allowed_by(w, "carrel.net.egress_allow")
}

test_network_of_another_entry_does_not_count if {
	# 10.0.0.0/8 is named by *.corp.example's entry, not pypi.org's.
	d := egress_with("pypi.org", 443, {"addresses": [{"ip": "10.9.8.7", "class": "private"}]}) with data.settings.net.egress_allow as local_list
	denied_by(d, "carrel.net.address_refused")

	# 192.168.1.1 is in none of allowed.test's networks.
	o := egress_with("allowed.test", 8443, {"addresses": [{"ip": "192.168.1.1", "class": "private"}]}) with data.settings.net.egress_allow as local_list
	denied_by(o, "carrel.net.address_refused")
}

test_name_only_decided_before_resolving if {
	d := egress_with("allowed.test", 8443, {}) with data.settings.net.egress_allow as local_list
	allowed_by(d, "carrel.net.egress_allow")
	d.reason == "egress to allowed.test:8443/tcp: allowed by allowed.test:8443 in settings.net.egress_allow"
}

test_ip_literal_needs_an_exact_entry if {
	d := egress_with("151.101.0.223", 443, {"ip_literal": true, "addresses": [{"ip": "151.101.0.223", "class": "public"}]})
		with data.settings.net.egress_allow as local_list
	denied_by(d, "carrel.net.ip_literal")
	d.reason == "egress to 151.101.0.223:443/tcp: an IP address, and no entry of settings.net.egress_allow names it"
}

test_ip_literal_wildcard_never_matches if {
	# "*.3" would match "10.1.2.3" as a string.
	d := egress_with("10.1.2.3", 443, {"ip_literal": true, "addresses": [{"ip": "10.1.2.3", "class": "private"}]})
		with data.settings.net.egress_allow as [{"host": "*.3", "port": 443, "networks": ["0.0.0.0/0"]}]
	denied_by(d, "carrel.net.ip_literal")
}

test_ip_literal_named_exactly_is_allowed if {
	d := egress_with("10.1.2.3", 5432, {"ip_literal": true, "addresses": [{"ip": "10.1.2.3", "class": "private"}]})
		with data.settings.net.egress_allow as local_list
	allowed_by(d, "carrel.net.egress_allow")
	m := egress_with("169.254.169.254", 80, {"ip_literal": true, "addresses": [{"ip": "169.254.169.254", "class": "metadata"}]})
		with data.settings.net.egress_allow as local_list
	allowed_by(m, "carrel.net.egress_allow")
	other := egress_with("10.1.2.4", 5432, {"ip_literal": true, "addresses": [{"ip": "10.1.2.4", "class": "private"}]})
		with data.settings.net.egress_allow as local_list
	denied_by(other, "carrel.net.ip_literal")
}

test_metadata_refused_by_name if {
	d := egress_with("metadata.google.internal", 80, {"addresses": [{"ip": "169.254.169.254", "class": "metadata"}]})
		with data.settings.net.egress_allow as [{"host": "metadata.google.internal", "port": 80}]
	denied_by(d, "carrel.net.address_refused")
}

test_port_still_decides_with_addresses if {
	d := egress_with("allowed.test", 8080, {"addresses": [{"ip": "127.0.0.1", "class": "loopback"}]}) with data.settings.net.egress_allow as local_list
	denied_by(d, "carrel.net.default_deny")
}

test_limits_default_none if {
	l := net.limits with input as net_input("egress", "pypi.org", 443)
	l == {}
}

test_limits_per_vm if {
	overrides := {"demo": {"net": {"limits": {"max_connections": 4}}}}
	l := net.limits with input as net_input("egress", "pypi.org", 443)
		with data.settings.net.limits as {"max_connections": 64, "bandwidth_bytes_per_second": 1048576}
		with data.settings.vms as overrides

	# An override names only the limits it changes.
	l == {"max_connections": 4, "bandwidth_bytes_per_second": 1048576}
	other := net.limits with input as object.union(net_input("egress", "pypi.org", 443), {"vm": "other"})
		with data.settings.net.limits as {"max_connections": 64, "bandwidth_bytes_per_second": 1048576}
		with data.settings.vms as overrides
	other == {"max_connections": 64, "bandwidth_bytes_per_second": 1048576}
}
