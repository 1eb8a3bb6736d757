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

decision := {
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
	root_user
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
	root_user
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

# root_user is true when the command would run as root, by name or uid.
root_user if user in {"root", "0"}

# The working directory must be readable under the fs rules, with this
# VM's fs settings.
default cwd_decision := {"allow": false, "rule": "carrel.exec.cwd_denied", "reason": "no working directory"}

cwd_decision := data.carrel.fs.check("read", input.cwd, false)
