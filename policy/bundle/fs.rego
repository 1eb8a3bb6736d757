# carrel.fs decides every file operation carreld relays into a VM, and
# gives the guest the roots it enforces again with Landlock (sandbox).
#
# Input (version 1):
#   {"version": 1, "vm": "demo", "caller": {...},
#    "operation": "read", "path": "/workspace/a.txt", "recursive": false}
# operation is one of read, write, create, delete, chmod, list, watch.
# path is absolute and lexically clean (no "..", "//", "." or trailing
# slash); the guest resolves symlinks and checks its roots again.
package carrel.fs

# settings is data.settings.fs, with data.settings.vms[NAME].fs merged
# over it when this VM has overrides. An override replaces each list it
# names as a whole.
settings := object.union(data.settings.fs, overrides) if {
	overrides := data.settings.vms[input.vm].fs
} else := data.settings.fs

# The operations carreld asks about. Under a read-only root only those
# that change nothing are allowed.
operations := {"read", "write", "create", "delete", "chmod", "list", "watch"}

read_only_operations := {"read", "list", "watch"}

# decision is always defined: an input too malformed for check gets this.
default decision := {
	"allow": false,
	"rule": "carrel.fs.default_deny",
	"reason": "malformed input",
}

decision := check(input.operation, input.path, input.recursive)

# check decides one operation on one path; carrel.exec uses it for a
# command's working directory. Denies come first: a secret path inside a
# read-write root is still denied.
check(operation, path, recursive) := {
	"allow": false,
	"rule": "carrel.fs.unknown_operation",
	"reason": concat("", [operation, " is not a file operation"]),
} if {
	not operation in operations
} else := {
	"allow": false,
	"rule": "carrel.fs.secret_path",
	"reason": concat("", [operation, " ", path, ": under secret path ", concat(", ", secrets)]),
} if {
	secrets := roots_holding(path, settings.secret_paths)
	count(secrets) > 0
} else := {
	"allow": false,
	"rule": "carrel.fs.secret_path",
	"reason": concat("", [operation, " ", path, ": has secret name ", concat(", ", names)]),
} if {
	names := secret_names_in(path)
	count(names) > 0
} else := {
	"allow": false,
	"rule": "carrel.fs.secret_path",
	"reason": concat("", [operation, " ", path, " recursively: would include secret path ", concat(", ", secrets)]),
} if {
	recursive != false
	secrets := {secret | some secret in settings.secret_paths; under(secret, path)}
	count(secrets) > 0
} else := {
	"allow": true,
	"rule": "carrel.fs.read_write_root",
	"reason": concat("", [operation, " ", path, ": under read-write root ", root]),
} if {
	root := max(roots_holding(path, settings.read_write))
} else := {
	"allow": true,
	"rule": "carrel.fs.read_only_root",
	"reason": concat("", [operation, " ", path, ": under read-only root ", root]),
} if {
	operation in read_only_operations
	root := max(roots_holding(path, settings.read_only))
} else := {
	"allow": false,
	"rule": "carrel.fs.default_deny",
	"reason": not_allowed(operation, path),
}

# secret_names_in is the set of settings.secret_names among path's
# components. strings.any_prefix_match is only a quick first test (.envrc
# starts with .env); the exact comparison decides.
secret_names_in(path) := {name | some name in components; name in settings.secret_names} if {
	components := split(path, "/")
	strings.any_prefix_match(components, settings.secret_names)
} else := set()

# roots_holding is the set of roots that path is at or beneath.
# strings.any_prefix_match is only a quick first test (/workspacex starts
# with /workspace); under decides.
roots_holding(path, roots) := {root | some root in roots; startswith(path, root); under(path, root)} if {
	strings.any_prefix_match(path, roots)
} else := set()

# not_allowed explains a default deny.
not_allowed(operation, path) := concat("", [operation, " ", path, ": ", root, " is a read-only root"]) if {
	root := max(roots_holding(path, settings.read_only))
} else := concat("", [operation, " ", path, ": not under any read-write or read-only root"])

# under is true when path is root or lies beneath it, by whole components:
# /workspace/a is under /workspace; /workspacex is not.
under(path, root) if path == root

under(path, root) if startswith(path, concat("", [root, "/"]))

under(path, "/") if startswith(path, "/")

# sandbox is what the guest enforces itself. Commands run under Landlock:
# read_write roots get every right, read_only roots read and execute. The
# guest's file service refuses paths outside the roots, and the denied
# (secret) paths. Landlock cannot express a secret inside a root, and the
# guest does not check secret names; the host denies both. The sandbox
# comes from the same settings as decision, so the two agree.
sandbox := {
	"read_write": settings.read_write,
	"read_only": settings.read_only,
	"denied": settings.secret_paths,
}
