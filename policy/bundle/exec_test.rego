package carrel.exec_test

import data.carrel.exec

# exec_input runs argv as user in cwd on VM demo, asked by a token holder.
exec_input(argv, user, cwd) := {
	"version": 1,
	"vm": "demo",
	"caller": {"type": "token", "token_id": "tok-1", "vm": "demo"},
	"argv": argv,
	"env": {"LANG": "C.UTF-8"},
	"cwd": cwd,
	"user": user,
	"tty": false,
}

decide(argv, user, cwd) := d if {
	d := exec.decision with input as exec_input(argv, user, cwd)
}

allowed_by(d, rule) if {
	d.allow == true
	d.rule == rule
}

denied_by(d, rule) if {
	d.allow == false
	d.rule == rule
}

test_agent_allowed if {
	d := decide(["sh", "-c", "ls"], "agent", "/workspace")
	allowed_by(d, "carrel.exec.user")
	d.reason == "user agent is in settings.exec.users"
}

test_agent_allowed_in_any_readable_cwd if {
	every cwd in ["/workspace/src", "/tmp", "/usr/share", "/etc"] {
		allowed_by(decide(["make"], "agent", cwd), "carrel.exec.user")
	}
}

test_other_users_denied if {
	every user in ["nobody", "1000", "agent2", "Agent", ""] {
		d := decide(["id"], user, "/workspace")
		denied_by(d, "carrel.exec.default_deny")
		d.reason == concat("", ["user ", user, " is not in settings.exec.users"])
	}
}

test_root_denied_by_default if {
	every user in ["root", "0"] {
		d := decide(["id"], user, "/workspace")
		denied_by(d, "carrel.exec.root_user")
		d.reason == concat("", ["user ", user, " is root, and settings.exec.allow_root is false"])
	}
}

test_root_denied_even_when_listed_in_users if {
	denied_by(decide(["id"], "root", "/workspace"), "carrel.exec.root_user") with data.settings.exec.users as ["agent", "root"]
}

test_root_allowed_with_allow_root if {
	allowed_by(decide(["id"], "root", "/workspace"), "carrel.exec.allow_root") with data.settings.exec.allow_root as true
	allowed_by(decide(["id"], "0", "/workspace"), "carrel.exec.allow_root") with data.settings.exec.allow_root as true
}

test_allow_root_must_be_true_not_truthy if {
	denied_by(decide(["id"], "root", "/workspace"), "carrel.exec.root_user") with data.settings.exec.allow_root as "yes"
}

test_denied_command_by_name_or_path if {
	every argv in [["curl", "https://example.com"], ["/usr/bin/curl"], ["./curl"], ["/opt/bin/wget", "-q"]] {
		d := decide(argv, "agent", "/workspace") with data.settings.exec.denied_commands as ["curl", "wget"]
		denied_by(d, "carrel.exec.denied_command")
	}
}

test_denied_command_reason_names_command if {
	d := decide(["/usr/bin/curl", "-s"], "agent", "/workspace") with data.settings.exec.denied_commands as ["curl"]
	d.reason == "curl is in settings.exec.denied_commands"
}

test_denied_commands_match_whole_names if {
	every argv in [["curlie"], ["/usr/bin/xcurl"], ["sh", "-c", "curl"], ["/curl/bin/ls"]] {
		d := decide(argv, "agent", "/workspace") with data.settings.exec.denied_commands as ["curl"]
		allowed_by(d, "carrel.exec.user")
	}
}

# Denied commands are names, not patterns.
test_denied_commands_are_literal if {
	denied_by(decide(["/usr/bin/g++", "-c"], "agent", "/workspace"), "carrel.exec.denied_command") with data.settings.exec.denied_commands as ["g++"]
	every argv in [["gcc"], ["/usr/bin/g"], ["ggg"]] {
		allowed_by(decide(argv, "agent", "/workspace"), "carrel.exec.user") with data.settings.exec.denied_commands as ["g++", ".*"]
	}
}

# An entry that is not a string names no user or command, and breaks
# nothing.
test_entries_that_are_not_strings_match_nothing if {
	allowed_by(decide(["ls"], "agent", "/workspace"), "carrel.exec.user") with data.settings.exec.users as [1000, "agent"]
	denied_by(decide(["ls"], "1000", "/workspace"), "carrel.exec.default_deny") with data.settings.exec.users as [1000, "agent"]
	allowed_by(decide(["ls"], "agent", "/workspace"), "carrel.exec.user") with data.settings.exec.denied_commands as [1, {"a": "ls"}]
	denied_by(decide(["curl"], "agent", "/workspace"), "carrel.exec.denied_command") with data.settings.exec.denied_commands as [1, "curl"]
}

test_no_command_denied if {
	denied_by(decide([], "agent", "/workspace"), "carrel.exec.no_command")
	denied_by(decide([""], "agent", "/workspace"), "carrel.exec.no_command")
	denied_by(decide(["/usr/bin/"], "agent", "/workspace"), "carrel.exec.no_command")
}

test_cwd_must_be_readable if {
	every cwd in ["/var", "/home/other", "/", "/workspacex"] {
		d := decide(["ls"], "agent", cwd)
		denied_by(d, "carrel.exec.cwd_denied")
		contains(d.reason, "carrel.fs.default_deny")
	}
}

test_secret_cwd_denied if {
	every cwd in ["/root", "/workspace/.ssh", "/workspace/app/.aws", "/etc/ssh"] {
		d := decide(["ls"], "agent", cwd)
		denied_by(d, "carrel.exec.cwd_denied")
		contains(d.reason, "carrel.fs.secret_path")
		contains(d.reason, cwd)
	}
}

test_cwd_reason if {
	d := decide(["ls"], "agent", "/var/lib")
	d.reason == "working directory: read /var/lib: not under any read-write or read-only root (carrel.fs.default_deny)"
}

test_root_checked_before_cwd if {
	denied_by(decide(["id"], "root", "/root"), "carrel.exec.root_user")
}

test_cwd_checked_for_root_too if {
	denied_by(decide(["id"], "root", "/root"), "carrel.exec.cwd_denied") with data.settings.exec.allow_root as true
}

test_cwd_follows_fs_vm_override if {
	overrides := {"demo": {"fs": {"read_write": ["/workspace", "/tmp", "/srv/build"]}}}
	allowed_by(decide(["ls"], "agent", "/srv/build"), "carrel.exec.user") with data.settings.vms as overrides
	denied_by(decide(["ls"], "agent", "/srv/build"), "carrel.exec.cwd_denied")
}

test_vm_override_allows_root_on_one_vm if {
	overrides := {"ops": {"exec": {"allow_root": true}}}
	ops := exec.decision with input as object.union(exec_input(["id"], "root", "/workspace"), {"vm": "ops"})
		with data.settings.vms as overrides
	allowed_by(ops, "carrel.exec.allow_root")
	denied_by(decide(["id"], "root", "/workspace"), "carrel.exec.root_user") with data.settings.vms as overrides
}

test_vm_override_replaces_users if {
	overrides := {"demo": {"exec": {"users": ["builder"]}}}
	allowed_by(decide(["make"], "builder", "/workspace"), "carrel.exec.user") with data.settings.vms as overrides
	denied_by(decide(["make"], "agent", "/workspace"), "carrel.exec.default_deny") with data.settings.vms as overrides
}

test_decision_defined_for_any_input if {
	every doc in [
		{},
		{"argv": ["ls"]},
		{"argv": ["ls"], "user": "agent"},
		{"argv": "ls", "user": "agent", "cwd": "/workspace"},
		{"user": "agent", "cwd": "/workspace"},
		{"argv": ["ls"], "cwd": "/workspace"},
		{"argv": ["ls"], "user": "agent"},
	] {
		d := exec.decision with input as doc
		d.allow == false
		startswith(d.rule, "carrel.exec.")
	}
}
