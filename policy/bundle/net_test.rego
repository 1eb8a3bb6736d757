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
