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

# decision is always defined: an input too malformed for check gets this.
default decision := {
	"allow": false,
	"rule": "carrel.fs.default_deny",
	"reason": "malformed input",
}

# decision is check(input.operation, input.path, input.recursive). The first
# branch is a shortcut for the common case, a plain operation under a
# read-write root: where quick_root answers, check would give the same. Its
# body is quick_root's, inline, which spares a function call.
decision := {
	"allow": true,
	"rule": "carrel.fs.read_write_root",
	"reason": concat("", [input.operation, " ", input.path, ": under read-write root ", root]),
} if {
	input.recursive == false
	input.operation in {"read", "write", "create", "delete", "chmod", "list", "watch"}
	[[_, root]] := regex.find_all_string_submatch_n(quick_pattern, input.path, 2)
	root != ""
} else := check(input.operation, input.path, input.recursive)

# check decides one operation on one path; carrel.exec uses it for a
# command's working directory. Denies come first: a secret path inside a
# read-write root is still denied. The operations are read, write, create,
# delete, chmod, list and watch; under a read-only root only read, list
# and watch, which change nothing, are allowed.
#
# Each list is tested whole with strings.any_prefix_match first, which is
# quick and false for most paths; it is only a first test (/workspacex
# starts with /workspace), and roots_holding or under then compares whole
# components. (A secret path beneath path starts with path.)
check(operation, path, recursive) := {
	"allow": false,
	"rule": "carrel.fs.unknown_operation",
	"reason": concat("", [operation, " is not a file operation"]),
} if {
	not operation in {"read", "write", "create", "delete", "chmod", "list", "watch"}
} else := {
	"allow": false,
	"rule": "carrel.fs.secret_path",
	"reason": concat("", [operation, " ", path, ": under secret path ", concat(", ", secrets)]),
} if {
	strings.any_prefix_match(path, settings.secret_paths)
	secrets := roots_holding(path, settings.secret_paths)
	count(secrets) > 0
} else := {
	"allow": false,
	"rule": "carrel.fs.secret_path",
	"reason": concat("", [operation, " ", path, ": has secret name ", concat(", ", names)]),
} if {
	components := split(path, "/")
	secret_names := settings.secret_names
	strings.any_prefix_match(components, secret_names)
	names := {name | some name in components; name in secret_names}
	count(names) > 0
} else := {
	"allow": false,
	"rule": "carrel.fs.secret_path",
	"reason": concat("", [operation, " ", path, " recursively: would include secret path ", concat(", ", secrets)]),
} if {
	recursive != false
	strings.any_prefix_match(settings.secret_paths, path)
	secrets := {secret | some secret in settings.secret_paths; under(secret, path)}
	count(secrets) > 0
} else := {
	"allow": true,
	"rule": "carrel.fs.read_write_root",
	"reason": concat("", [operation, " ", path, ": under read-write root ", root]),
} if {
	strings.any_prefix_match(path, settings.read_write)
	root := max(roots_holding(path, settings.read_write))
} else := {
	"allow": true,
	"rule": "carrel.fs.read_only_root",
	"reason": concat("", [operation, " ", path, ": under read-only root ", root]),
} if {
	operation in {"read", "list", "watch"}
	strings.any_prefix_match(path, settings.read_only)
	root := max(roots_holding(path, settings.read_only))
} else := {
	"allow": false,
	"rule": "carrel.fs.default_deny",
	"reason": not_allowed(operation, path),
}

# quick_root is the read-write root that check names when it allows a
# non-recursive operation on path (the caller sees to recursive), in the
# common case where no deny can apply: the operation is known, and no
# secret path starts path, nor any secret name a component of it, not even
# as a prefix. It is undefined otherwise, and check decides; so it is for
# a path that only the root / holds.
#
# It is one match of quick_pattern, which is made from settings alone and
# which carreld works out once per VM when it compiles the bundle (see
# docs/policy.md).
quick_root(operation, path) := root if {
	operation in {"read", "write", "create", "delete", "chmod", "list", "watch"}
	[[_, root]] := regex.find_all_string_submatch_n(quick_pattern, path, 2)
	root != ""
}

# quick_pattern finds, in one pass over a path, a read-write root that
# holds it and every place where a secret could begin. Its alternatives, in
# the order a match at the start tries them:
#   1. a secret path starting the path (as a prefix: /rootx counts);
#   2. a quick root, then a component that a secret name starts;
#   3. a quick root, by whole components, captured: the only alternative
#      with a group;
#   4. anywhere after that, a component that a secret name starts.
# A path is the common case when quick_pattern matches it exactly once,
# with the root captured: 3 matched at the start and nothing after it did.
# The roots are tried deepest first, so the root captured is the greatest
# that holds the path, as check names it.
quick_pattern := concat("|", [
	concat("", ["^", any_of(settings.secret_paths)]),
	concat("", ["^", any_of(quick_roots), "/", any_of(settings.secret_names)]),
	concat("", ["^(", any_of(quick_roots), ")(?:/|$)"]),
	concat("", ["/", any_of(settings.secret_names)]),
])

# quick_roots are the read-write roots quick_pattern may capture, deepest
# first: all but / (and ""), which check names, and any root with a
# component that a secret name starts, which the match of 3 would pass
# over. A path beneath such a root holds that component, so 2 or 4 still
# sees it in the rest of the path when a shallower root is captured.
quick_roots := array.reverse(sort([r |
	some r in settings.read_write
	not r in {"", "/"}
	not strings.any_prefix_match(split(r, "/"), settings.secret_names)
]))

# any_of is a regular expression matching any of strings, literally; with
# no strings, it matches nothing.
any_of(strings) := concat("", ["(?:", concat("|", [quote(s) | some s in strings]), ")"]) if {
	count(strings) > 0
} else := `[^\x00-\x{10FFFF}]`

# quote escapes the characters that mean something in a regular expression.
quote(s) := regex.replace(s, `[\\.+*?()|\[\]{}^$]`, `\$0`)

# roots_holding is the set of roots that path is at or beneath, by whole
# components: what follows the root in path is nothing or a "/", so
# /workspace holds /workspace and /workspace/a, not /workspacex. The root
# / holds every absolute path.
roots_holding(path, roots) := {root |
	some root in roots
	startswith(path, root)
	substring(path, count(root), 1) in {"", "/"}
} | {"/" | "/" in roots; startswith(path, "/")}

# not_allowed explains a default deny.
not_allowed(operation, path) := concat("", [operation, " ", path, ": ", root, " is a read-only root"]) if {
	strings.any_prefix_match(path, settings.read_only)
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
