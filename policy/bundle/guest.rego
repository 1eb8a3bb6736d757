# carrel.guest decides what the agent inside a VM may ask its host for,
# e.g. a checkpoint before a risky step. The guest is not trusted: every
# request is denied unless settings.guest.allowed_requests names it.
#
# Input (version 1):
#   {"version": 1, "vm": "demo", "request": "checkpoint", "args": {}}
# There is no caller: the guest asks.
package carrel.guest

# settings is data.settings.guest, with data.settings.vms[NAME].guest merged
# over it when this VM has overrides. An override replaces each list it
# names as a whole.
settings := object.union(data.settings.guest, overrides) if {
	overrides := data.settings.vms[input.vm].guest
} else := data.settings.guest

# decision is always defined: an input too malformed for the rules below
# gets this.
default decision := {
	"allow": false,
	"rule": "carrel.guest.default_deny",
	"reason": "malformed input",
}

decision := {
	"allow": true,
	"rule": "carrel.guest.allowed_request",
	"reason": concat("", ["guest request ", input.request, " is in settings.guest.allowed_requests"]),
} if {
	input.request in settings.allowed_requests
} else := {
	"allow": false,
	"rule": "carrel.guest.default_deny",
	"reason": concat("", ["guest request ", input.request, " is not in settings.guest.allowed_requests"]),
}
