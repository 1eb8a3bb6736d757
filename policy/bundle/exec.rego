# carrel.exec decides whether a command may start in a VM.
#
# Input (version 1):
#   {"version": 1, "vm": "demo", "caller": {...},
#    "argv": ["sh", "-c", "ls"], "env": {"K": "V"},
#    "cwd": "/workspace", "user": "agent", "tty": false}
# carreld fills in the guest's defaults first: user "agent", cwd "/workspace".
package carrel.exec

# settings is data.settings.exec, with data.settings.vms[NAME].exec merged
# over it when this VM has overrides. An override replaces each list it
# names as a whole.
settings := object.union(data.settings.exec, overrides) if {
	overrides := data.settings.vms[input.vm].exec
} else := data.settings.exec

# The first branch is the common allow, stated whole: a user in
# settings.exec.users who is not root, a program that is not denied, and a
# working directory under a read-write root that no secret path or name
# starts (where fs.quick_root would answer). Each of its conditions rules
# out a deny below, so where it applies the branches below give the same
# decision. Its patterns and reasons come from settings alone, which
# carreld works out once per VM when it compiles the bundle (see
# docs/policy.md).
#
# A command run as user "root" or "0" runs as root, by name or uid. The two
# root branches test input.user against that literal set, which lets OPA
# skip both for any other user without evaluating them.
decision := {
	"allow": true,
	"rule": "carrel.exec.user",
	"reason": reason,
} if {
	reason := plain_users[input.user]
	regex.match(refused_command_pattern, input.argv[0]) == false
	[[_, cwd_root]] := regex.find_all_string_submatch_n(data.carrel.fs.quick_pattern, input.cwd, 2)
	cwd_root != ""
} else := {
	"allow": false,
	"rule": "carrel.exec.no_command",
	"reason": "argv is empty or argv[0] names no program",
} if {
	command == ""
} else := {
	"allow": false,
	"rule": "carrel.exec.root_user",
	"reason": concat("", ["user ", user, " is root, and settings.exec.allow_root is false"]),
} if {
	input.user in {"root", "0"}
	settings.allow_root != true
} else := {
	"allow": false,
	"rule": "carrel.exec.denied_command",
	"reason": concat("", [command, " is in settings.exec.denied_commands"]),
} if {
	command in settings.denied_commands
} else := {
	"allow": false,
	"rule": "carrel.exec.cwd_denied",
	"reason": concat("", ["working directory: ", cwd_decision.reason, " (", cwd_decision.rule, ")"]),
} if {
	cwd_decision.allow != true
} else := {
	"allow": true,
	"rule": "carrel.exec.allow_root",
	"reason": concat("", ["user ", user, " is root, and settings.exec.allow_root is true"]),
} if {
	input.user in {"root", "0"}
	settings.allow_root == true
} else := {
	"allow": true,
	"rule": "carrel.exec.user",
	"reason": concat("", ["user ", user, " is in settings.exec.users"]),
} if {
	user in settings.users
} else := {
	"allow": false,
	"rule": "carrel.exec.default_deny",
	"reason": concat("", ["user ", user, " is not in settings.exec.users"]),
}

# command is the program argv[0] names, without its directory:
# "/usr/bin/curl" and "curl" are both "curl". It is only a speed bump
# (sh -c "curl ..." runs curl too); the net rules are the wall.
default command := ""

command := base if {
	parts := split(input.argv[0], "/")
	base := parts[count(parts) - 1]
}

default user := ""

user := input.user

# plain_users are the users in settings.exec.users that are not root, each
# with the reason that allows it.
plain_users := {user: concat("", ["user ", user, " is in settings.exec.users"]) |
	some user in settings.users
	is_string(user)
	not user in {"root", "0"}
}

# refused_command_pattern matches an argv[0] that names no program (it is
# empty or ends in /) or whose program is in settings.exec.denied_commands.
refused_command_pattern := concat("", ["(?:^|/)", data.carrel.fs.any_of(denied_names), "?$"])

# denied_names are the names in settings.exec.denied_commands; no command
# is anything else.
denied_names := [name | some name in settings.denied_commands; is_string(name)]

# The working directory must be readable under the fs rules, with this
# VM's fs settings. cwd_decision is fs.check's decision on reading it,
# except in the common case, where fs.quick_root answers (as it does for
# carrel.fs.decision): check would allow, and cwd_decision holds only
# allow, since rule and reason are read only when it denies.
default cwd_decision := {"allow": false, "rule": "carrel.exec.cwd_denied", "reason": "no working directory"}

cwd_decision := {"allow": true} if {
	data.carrel.fs.quick_root("read", input.cwd)
} else := data.carrel.fs.check("read", input.cwd, false)
