# carrel.net decides network connections to and from a VM.
#
# Input (version 1):
#   {"version": 1, "vm": "demo", "caller": {...},
#    "direction": "egress", "host": "registry.npmjs.org", "port": 443,
#    "protocol": "tcp"}
# egress: the VM reaching out through the host's proxy (no caller: the
# guest asks). forward: a host-side client reaching a port inside the VM
# (carrel port-forward). host is lower case, without a trailing dot.
package carrel.net

# settings is data.settings.net, with data.settings.vms[NAME].net merged
# over it when this VM has overrides. An override replaces each list it
# names as a whole.
settings := object.union(data.settings.net, overrides) if {
	overrides := data.settings.vms[input.vm].net
} else := data.settings.net

# decision is always defined: an input without a direction gets this.
default decision := {
	"allow": false,
	"rule": "carrel.net.default_deny",
	"reason": "unknown direction",
}

# Each branch but the last names the direction it is about first, so that
# OPA skips the branches for the other direction without evaluating them.
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
	"reason": sprintf("egress to %v:%v/%v: allowed by %v in settings.net.egress_allow", [input.host, input.port, input.protocol, concat(", ", entries)]),
} if {
	input.direction == "egress"
	settings.egress_allow != [] # a quick test: egress is denied by default
	entries := egress_allowed
	count(entries) > 0
} else := {
	"allow": false,
	"rule": "carrel.net.default_deny",
	"reason": sprintf("forward to port %v: settings.net.allow_forward is not true", [input.port]),
} if {
	input.direction == "forward"
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

# egress_allowed names every entry of settings.net.egress_allow that allows
# this connection. An entry is {"host", "port"} and optionally "protocol"
# (default "tcp"). host is a name, exact, or "*.example.com" for any name
# below example.com (not example.com itself).
egress_allowed := {sprintf("%v:%v", [entry.host, entry.port]) |
	some entry in settings.egress_allow
	entry.port == input.port
	host_matches(entry.host, input.host)
	object.get(entry, "protocol", "tcp") == input.protocol
}

host_matches(pattern, host) if pattern == host

host_matches(pattern, host) if {
	startswith(pattern, "*.")
	endswith(host, substring(pattern, 1, -1))
}
