# carrel.net decides network connections to and from a VM.
#
# Input (version 1):
#   {"version": 1, "vm": "demo", "caller": {...},
#    "direction": "egress", "host": "registry.npmjs.org", "port": 443,
#    "protocol": "tcp", "ip_literal": true,
#    "addresses": [{"ip": "104.16.0.35", "class": "public"}]}
# egress: the VM reaching out through the host's proxy (no caller: the
# guest asks). forward: a host-side client reaching a port inside the VM
# (carrel port-forward). host is lower case, without a trailing dot.
# ip_literal is present (true) when host is an IP address. addresses is
# what carreld resolved host to, each with its class (public, private,
# loopback, link_local, cgnat, unspecified, multicast, metadata,
# reserved); it is absent while carreld asks about the name alone, before
# it resolves it. carreld connects only when both decisions allow.
package carrel.net

# settings is data.settings.net, with data.settings.vms[NAME].net merged
# over it when this VM has overrides. An override replaces each list it
# names as a whole.
settings := object.union(data.settings.net, overrides) if {
	overrides := data.settings.vms[input.vm].net
} else := data.settings.net

# limits are what carreld enforces on the VM's egress besides decisions:
# max_connections (open at once) and bandwidth_bytes_per_second (each way,
# over all its connections). A missing or zero limit is no limit.
default limits := {}

limits := settings.limits

# decision is always defined: an input without a direction gets this.
default decision := {
	"allow": false,
	"rule": "carrel.net.default_deny",
	"reason": "unknown direction",
}

# Each branch but the last names the direction it is about first, so that
# OPA skips the branches for the other direction without evaluating them.
# The egress allow states every condition that rules out the egress
# denies below it, so an allow never hides a deny.
decision := {
	"allow": true,
	"rule": "carrel.net.forward",
	"reason": sprintf("forward to port %v: settings.net.allow_forward is true", [input.port]),
} if {
	input.direction == "forward"
	settings.allow_forward == true
} else := {
	"allow": true,
	"rule": "carrel.net.egress_allow",
	"reason": sprintf("egress to %v:%v/%v: allowed by %v in settings.net.egress_allow%v", [input.host, input.port, input.protocol, concat(", ", egress_allowed), addresses_note]),
} if {
	input.direction == "egress"
	egress_allow != [] # a quick test: egress is denied by default
	count(egress_allowed) > 0
	count(refused_addresses) == 0
} else := {
	"allow": false,
	"rule": "carrel.net.default_deny",
	"reason": sprintf("forward to port %v: settings.net.allow_forward is not true", [input.port]),
} if {
	input.direction == "forward"
} else := {
	"allow": false,
	"rule": "carrel.net.ip_literal",
	"reason": sprintf("egress to %v:%v/%v: an IP address, and no entry of settings.net.egress_allow names it", [input.host, input.port, input.protocol]),
} if {
	input.direction == "egress"
	input.ip_literal == true
	count(egress_allowed) == 0
} else := {
	"allow": false,
	"rule": "carrel.net.default_deny",
	"reason": sprintf("egress to %v:%v/%v: not in settings.net.egress_allow", [input.host, input.port, input.protocol]),
} if {
	# A quick test for the last egress deny: with no entries, no address
	# can be refused.
	input.direction == "egress"
	egress_allow == []
} else := {
	"allow": false,
	"rule": "carrel.net.address_refused",
	"reason": sprintf("egress to %v:%v/%v: %v, and no entry that allows the host names it in its networks", [input.host, input.port, input.protocol, concat(", ", refused_addresses)]),
} if {
	input.direction == "egress"
	count(egress_allowed) > 0
	count(refused_addresses) > 0
} else := {
	"allow": false,
	"rule": "carrel.net.default_deny",
	"reason": sprintf("egress to %v:%v/%v: not in settings.net.egress_allow", [input.host, input.port, input.protocol]),
} if {
	input.direction == "egress"
} else := {
	"allow": false,
	"rule": "carrel.net.default_deny",
	"reason": sprintf("unknown direction %v", [input.direction]),
}

# egress_allow is settings.egress_allow, which the decision's quick tests
# read.
egress_allow := settings.egress_allow

# allowing_entries are the entries of settings.net.egress_allow that allow
# this connection's host, port and protocol. An entry is {"host", "port"},
# optionally "protocol" (default "tcp") and "networks" (CIDRs). host is a
# name, exact, or "*.example.com" for any name below example.com (not
# example.com itself); an IP address host is matched by an entry naming
# that address exactly, never by a wildcard.
allowing_entries contains entry if {
	some entry in settings.egress_allow
	entry.port == input.port
	host_matches(entry.host, input.host)
	object.get(entry, "protocol", "tcp") == input.protocol
}

# egress_allowed names the allowing entries, for reasons.
egress_allowed := {sprintf("%v:%v", [entry.host, entry.port]) | some entry in allowing_entries}

host_matches(pattern, host) if pattern == host

host_matches(pattern, host) if {
	not input.ip_literal
	startswith(pattern, "*.")
	endswith(host, substring(pattern, 1, -1))
}

# refused_addresses are the addresses host resolved to that are not public
# and that no allowing entry names: in its "networks", or, for an IP
# address host, as its own host.
refused_addresses contains sprintf("%v is %v", [a.ip, a.class]) if {
	some a in object.get(input, "addresses", [])
	a.class != "public"
	not address_named(a.ip)
}

address_named(ip) if {
	some entry in allowing_entries
	some network in object.get(entry, "networks", [])
	net.cidr_contains(network, ip)
}

address_named(ip) if {
	input.ip_literal == true
	ip == input.host
	some entry in allowing_entries
	entry.host == ip
}

# addresses_note names, in an allow's reason, the addresses decided on.
addresses_note := sprintf(" (addresses %v)", [concat(", ", [sprintf("%v %v", [a.ip, a.class]) | some a in input.addresses])]) if {
	count(input.addresses) > 0
} else := ""
