package carrel.fs_test

import data.carrel.fs

# fs_input is a file operation from an operator's process on VM demo.
fs_input(operation, path) := {
	"version": 1,
	"vm": "demo",
	"caller": {"type": "peer", "uid": 0, "gid": 0, "pid": 4242},
	"operation": operation,
	"path": path,
	"recursive": false,
}

decide(operation, path) := d if {
	d := fs.decision with input as fs_input(operation, path)
}

decide_recursive(operation, path) := d if {
	d := fs.decision with input as object.union(fs_input(operation, path), {"recursive": true})
}

allowed_by(d, rule) if {
	d.allow == true
	d.rule == rule
}

denied_by(d, rule) if {
	d.allow == false
	d.rule == rule
}

all_operations := ["read", "write", "create", "delete", "chmod", "list", "watch"]

# Read-write roots: every operation, on the root and beneath it.

test_read_write_roots_allow_every_operation if {
	every operation in all_operations {
		every path in ["/workspace", "/workspace/a.txt", "/workspace/src/deep/er/main.go", "/tmp", "/tmp/x"] {
			allowed_by(decide(operation, path), "carrel.fs.read_write_root")
		}
	}
}

test_read_write_reason_names_path_and_root if {
	d := decide("write", "/workspace/src/main.go")
	d.reason == "write /workspace/src/main.go: under read-write root /workspace"
}

test_read_write_recursive_allowed if {
	allowed_by(decide_recursive("delete", "/workspace/build"), "carrel.fs.read_write_root")
	allowed_by(decide_recursive("read", "/workspace"), "carrel.fs.read_write_root")
	allowed_by(decide_recursive("watch", "/tmp"), "carrel.fs.read_write_root")
}

# Roots match whole components only.

test_sibling_with_root_as_prefix_denied if {
	denied_by(decide("read", "/workspacex"), "carrel.fs.default_deny")
	denied_by(decide("write", "/workspacex/a"), "carrel.fs.default_deny")
	denied_by(decide("write", "/workspace-other/a"), "carrel.fs.default_deny")
	denied_by(decide("write", "/tmpfs/a"), "carrel.fs.default_deny")
	denied_by(decide("read", "/usrx/bin/sh"), "carrel.fs.default_deny")
	denied_by(decide("read", "/etcetera"), "carrel.fs.default_deny")
}

# Read-only roots: read, list and watch only.

test_read_only_roots_allow_reading if {
	every operation in ["read", "list", "watch"] {
		every path in ["/usr/bin/python3", "/bin/sh", "/lib/x86_64-linux-gnu/libc.so.6", "/etc/hostname", "/etc", "/proc/cpuinfo", "/sys/kernel", "/dev/null", "/opt/tool", "/nix/store/abc-hello/bin/hello"] {
			allowed_by(decide(operation, path), "carrel.fs.read_only_root")
		}
	}
}

test_read_only_roots_deny_changes if {
	every operation in ["write", "create", "delete", "chmod"] {
		every path in ["/usr/bin/python3", "/etc/passwd", "/etc", "/bin/sh"] {
			denied_by(decide(operation, path), "carrel.fs.default_deny")
		}
	}
}

test_read_only_deny_reason_names_root if {
	d := decide("write", "/etc/passwd")
	d.reason == "write /etc/passwd: /etc is a read-only root"
}

test_read_only_reason_names_path_and_root if {
	d := decide("read", "/usr/bin/env")
	d.reason == "read /usr/bin/env: under read-only root /usr"
}

# Secret paths: denied for every operation, in every root.

test_secret_paths_denied_for_every_operation if {
	every operation in all_operations {
		every path in ["/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/ssh/ssh_host_ed25519_key", "/etc/ssh", "/root", "/root/.bashrc", "/proc/kcore", "/run/secrets", "/run/secrets/token"] {
			denied_by(decide(operation, path), "carrel.fs.secret_path")
		}
	}
}

test_secret_path_reason_names_path_and_pattern if {
	d := decide("read", "/etc/ssh/ssh_host_rsa_key")
	d.reason == "read /etc/ssh/ssh_host_rsa_key: under secret path /etc/ssh"
}

test_secret_paths_match_whole_components if {
	allowed_by(decide("read", "/etc/shadowsocks.conf"), "carrel.fs.read_only_root")
	allowed_by(decide("read", "/etc/sshd_banner"), "carrel.fs.read_only_root")
	denied_by(decide("read", "/rootfs"), "carrel.fs.default_deny")
}

test_secret_names_denied_anywhere if {
	every operation in all_operations {
		every path in [
			"/workspace/.env",
			"/workspace/app/.env",
			"/workspace/a/b/c/d/e/.env",
			"/workspace/.ssh",
			"/workspace/project/.ssh/id_ed25519",
			"/tmp/.ssh/known_hosts",
			"/workspace/deep/er/.aws/credentials",
			"/workspace/.gnupg/private-keys-v1.d/x.key",
			"/home/agent/.ssh/id_rsa",
			"/etc/.env",
		] {
			denied_by(decide(operation, path), "carrel.fs.secret_path")
		}
	}
}

test_secret_name_reason_names_path_and_name if {
	d := decide("write", "/workspace/app/.aws/config")
	d.reason == "write /workspace/app/.aws/config: has secret name .aws"
}

test_secret_names_match_whole_components if {
	every path in ["/workspace/.env.example", "/workspace/.envrc", "/workspace/x.env", "/workspace/my.ssh", "/workspace/.sshd/config", "/workspace/aws/config", "/workspace/env"] {
		allowed_by(decide("write", path), "carrel.fs.read_write_root")
	}
}

test_secret_beats_read_write_root if {
	denied_by(decide("read", "/workspace/.env"), "carrel.fs.secret_path")
	allowed_by(decide("read", "/workspace/env"), "carrel.fs.read_write_root")
}

# A recursive operation covers its whole tree.

test_recursive_over_secret_path_denied if {
	denied_by(decide_recursive("read", "/etc"), "carrel.fs.secret_path")
	denied_by(decide_recursive("list", "/"), "carrel.fs.secret_path")
	denied_by(decide_recursive("watch", "/run"), "carrel.fs.secret_path")
	d := decide_recursive("read", "/proc")
	d.reason == "read /proc recursively: would include secret path /proc/kcore"
}

test_recursive_without_secret_below_allowed if {
	allowed_by(decide_recursive("read", "/etc/ssl"), "carrel.fs.read_only_root")
	allowed_by(decide_recursive("list", "/usr"), "carrel.fs.read_only_root")
}

test_non_recursive_listing_of_secret_parent_allowed if {
	allowed_by(decide("list", "/etc"), "carrel.fs.read_only_root")
}

# Everything else is denied.

test_outside_every_root_denied if {
	every path in ["/", "/home/other/notes.txt", "/var/log/syslog", "/run/user/1000", "/srv", "/mnt/disk"] {
		d := decide("read", path)
		denied_by(d, "carrel.fs.default_deny")
		d.reason == concat("", ["read ", path, ": not under any read-write or read-only root"])
	}
}

test_unknown_operation_denied_everywhere if {
	denied_by(decide("exec", "/workspace/a"), "carrel.fs.unknown_operation")
	denied_by(decide("", "/workspace/a"), "carrel.fs.unknown_operation")
	denied_by(decide("READ", "/workspace/a"), "carrel.fs.unknown_operation")
}

test_relative_or_empty_path_denied if {
	denied_by(decide("read", "workspace/a"), "carrel.fs.default_deny")
	denied_by(decide("read", ""), "carrel.fs.default_deny")
}

test_decision_defined_for_any_input if {
	every doc in [
		{},
		{"operation": "read"},
		{"operation": "read", "path": "/workspace/a"},
		{"path": "/workspace/a", "recursive": false},
		{"operation": "read", "recursive": false},
	] {
		d := fs.decision with input as doc
		denied_by(d, "carrel.fs.default_deny")
	}
}

test_decision_is_well_formed if {
	every path in ["/workspace/a", "/etc/shadow", "/var/x", "/usr/bin/sh"] {
		d := decide("write", path)
		is_boolean(d.allow)
		startswith(d.rule, "carrel.fs.")
		d.reason != ""
	}
}

# The recursive flag fails closed: anything but false counts as recursive.

test_recursive_flag_fails_closed if {
	d := fs.decision with input as object.union(fs_input("read", "/etc"), {"recursive": "yes"})
	denied_by(d, "carrel.fs.secret_path")
}

# Per-VM overrides.

test_vm_override_adds_read_write_root if {
	overrides := {"build": {"fs": {"read_write": ["/workspace", "/tmp", "/home/agent", "/srv/cache"]}}}
	build := fs.decision with input as object.union(fs_input("write", "/srv/cache/go"), {"vm": "build"})
		with data.settings.vms as overrides
	allowed_by(build, "carrel.fs.read_write_root")

	# Other VMs keep the defaults.
	demo := fs.decision with input as fs_input("write", "/srv/cache/go")
		with data.settings.vms as overrides
	denied_by(demo, "carrel.fs.default_deny")

	# Settings the override does not name keep their defaults.
	secret := fs.decision with input as object.union(fs_input("read", "/home/agent/.ssh/id_rsa"), {"vm": "build"})
		with data.settings.vms as overrides
	denied_by(secret, "carrel.fs.secret_path")
}

test_vm_override_replaces_a_list_whole if {
	overrides := {"demo": {"fs": {"read_write": ["/workspace"]}}}
	denied_by(decide("write", "/tmp/x"), "carrel.fs.default_deny") with data.settings.vms as overrides
	allowed_by(decide("write", "/workspace/x"), "carrel.fs.read_write_root") with data.settings.vms as overrides
}

test_vm_override_can_drop_a_secret_name if {
	overrides := {"demo": {"fs": {"secret_names": [".ssh", ".gnupg", ".aws"]}}}
	allowed_by(decide("read", "/workspace/.env"), "carrel.fs.read_write_root") with data.settings.vms as overrides
	denied_by(decide("read", "/workspace/.ssh/x"), "carrel.fs.secret_path") with data.settings.vms as overrides
}

test_most_specific_root_named if {
	d := decide("write", "/workspace/cache/x") with data.settings.fs.read_write as ["/workspace", "/workspace/cache"]
	d.reason == "write /workspace/cache/x: under read-write root /workspace/cache"
}

test_read_write_root_inside_read_only_root if {
	d := decide("write", "/opt/work/x") with data.settings.fs.read_write as ["/opt/work"]
	allowed_by(d, "carrel.fs.read_write_root")
	denied_by(decide("write", "/opt/other"), "carrel.fs.default_deny") with data.settings.fs.read_write as ["/opt/work"]
}

test_root_slash_holds_everything if {
	allowed_by(decide("read", "/var/log/syslog"), "carrel.fs.read_only_root") with data.settings.fs.read_only as ["/"]
	allowed_by(decide("list", "/"), "carrel.fs.read_only_root") with data.settings.fs.read_only as ["/"]
	denied_by(decide("read", "/etc/shadow"), "carrel.fs.secret_path") with data.settings.fs.read_only as ["/"]
}

# under matches whole components.

test_under if {
	fs.under("/workspace", "/workspace")
	fs.under("/workspace/a", "/workspace")
	fs.under("/workspace/a/b", "/workspace")
	fs.under("/x", "/")
	fs.under("/", "/")
	not fs.under("/workspacex", "/workspace")
	not fs.under("/work", "/workspace")
	not fs.under("/", "/workspace")
	not fs.under("relative", "/")
}

# roots_holding matches whole components too; / holds every absolute path.

test_roots_holding if {
	fs.roots_holding("/workspace/a", ["/workspace", "/workspacex", "/work", "/tmp", "/"]) == {"/workspace", "/"}
	fs.roots_holding("/workspace", ["/workspace", "/workspace/a"]) == {"/workspace"}
	fs.roots_holding("/", ["/", "/workspace"]) == {"/"}
	fs.roots_holding("relative", ["/", "relative"]) == {"relative"}
	fs.roots_holding("/workspace/a", []) == set()
}

# decision takes a shortcut, quick_root, for a plain operation under a
# read-write root. It must agree with check everywhere, and leave every
# path that merely looks secret to check.

test_shortcut_agrees_with_check if {
	every operation in array.concat(all_operations, ["exec"]) {
		every path in [
			"/workspace", "/workspace/src/main.go", "/workspacex/a", "/tmp/x", "/tmp/.ssh/known_hosts",
			"/workspace/.env", "/workspace/.envrc", "/workspace/a/.aws/config", "/usr/bin/env", "/etc",
			"/etc/shadow", "/root", "/var/x", "/", "relative", "",
		] {
			decide(operation, path) == fs.check(operation, path, false) with input as fs_input(operation, path)
		}
	}
}

test_shortcut_defers_to_check if {
	fs.quick_root("write", "/workspace/src/main.go") == "/workspace"
	every path in ["/workspace/.envrc", "/workspace/app/.ssh/x", "/workspacex", "/usr/bin/env"] {
		not fs.quick_root("write", path)
	}
	not fs.quick_root("exec", "/workspace/a")

	# A path under a read-write root that only starts like a secret path:
	# check decides, and allows it.
	not fs.quick_root("write", "/workspace/secrets") with data.settings.fs.secret_paths as ["/workspace/secret"]
	allowed_by(decide("write", "/workspace/secrets"), "carrel.fs.read_write_root") with data.settings.fs.secret_paths as ["/workspace/secret"]
	denied_by(decide("write", "/workspace/secret/x"), "carrel.fs.secret_path") with data.settings.fs.secret_paths as ["/workspace/secret"]
}

test_shortcut_names_the_deepest_root if {
	fs.quick_root("write", "/workspace/cache/x") == "/workspace/cache" with data.settings.fs.read_write as ["/workspace", "/workspace/cache"]
	fs.quick_root("write", "/workspace/cache/x") == "/workspace/cache" with data.settings.fs.read_write as ["/workspace/cache", "/workspace"]
	fs.quick_root("write", "/workspace/x") == "/workspace" with data.settings.fs.read_write as ["/", "/workspace"]
}

# quick_pattern sees a secret name wherever a component starts: right
# after the root, deeper down, and inside a root, which it then never
# captures. A shallower root still answers for paths beside it.
test_shortcut_finds_secret_names_everywhere if {
	roots := ["/w", "/w/a/.envx", "/srv/.aws-cache"]
	every path in ["/w/.env", "/w/a/.ssh", "/w/a/b/.gnupg/x", "/w/a/.envx/f", "/srv/.aws-cache/x", "/w/.env/.ssh"] {
		not fs.quick_root("write", path) with data.settings.fs.read_write as roots
		decide("write", path) == fs.check("write", path, false) with input as fs_input("write", path) with data.settings.fs.read_write as roots
	}
	fs.quick_root("write", "/w/a/x") == "/w" with data.settings.fs.read_write as roots
	fs.quick_root("write", "/w/a/b.env") == "/w" with data.settings.fs.read_write as roots
	allowed_by(decide("write", "/srv/.aws-cache/x"), "carrel.fs.read_write_root") with data.settings.fs.read_write as roots with data.settings.fs.secret_names as [".ssh"]
	fs.quick_root("write", "/srv/.aws-cache/x") == "/srv/.aws-cache" with data.settings.fs.read_write as roots with data.settings.fs.secret_names as [".ssh"]
}

# A secret path starting a path is found before the root it lies under.
test_shortcut_finds_secret_paths_under_roots if {
	not fs.quick_root("write", "/workspace/keys/a") with data.settings.fs.secret_paths as ["/workspace/keys"]
	denied_by(decide("write", "/workspace/keys/a"), "carrel.fs.secret_path") with data.settings.fs.secret_paths as ["/workspace/keys"]
	not fs.quick_root("write", "/workspace/a") with data.settings.fs.secret_paths as ["/workspace"] with data.settings.fs.read_write as ["/workspace/a", "/workspace"]
}

# The root / is left to check, which names it; so is "".
test_shortcut_leaves_the_root_slash_to_check if {
	not fs.quick_root("write", "/x") with data.settings.fs.read_write as ["/"]
	allowed_by(decide("write", "/x"), "carrel.fs.read_write_root") with data.settings.fs.read_write as ["/"]
	decide("write", "/x").reason == "write /x: under read-write root /" with data.settings.fs.read_write as ["/"]
	decide("write", "/var/x") == fs.check("write", "/var/x", false) with data.settings.fs.read_write as ["/", ""]
	decide("write", "/var/x").reason == "write /var/x: under read-write root /" with data.settings.fs.read_write as ["/", ""]
}

# The patterns take roots and names literally.
test_shortcut_quotes_patterns if {
	fs.quick_root("write", "/srv/a+b/x") == "/srv/a+b" with data.settings.fs.read_write as ["/srv/a+b"]
	not fs.quick_root("write", "/srv/aab/x") with data.settings.fs.read_write as ["/srv/a+b"]
	not fs.quick_root("write", "/w/x.key") with data.settings.fs.read_write as ["/w"] with data.settings.fs.secret_names as ["x.k"]
	fs.quick_root("write", "/w/xykey") == "/w" with data.settings.fs.read_write as ["/w"] with data.settings.fs.secret_names as ["x.k"]
	fs.quick_root("write", "/w/a") == "/w" with data.settings.fs.read_write as ["/w"] with data.settings.fs.secret_names as [] with data.settings.fs.secret_paths as []
}

# The sandbox comes from the same settings as the decision.

test_sandbox_default if {
	s := fs.sandbox with input as {"version": 1, "vm": "demo"}
	s.read_write == ["/workspace", "/home/agent", "/tmp"]
	s.read_only == ["/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/opt", "/nix", "/proc", "/sys", "/dev"]
	s.denied == ["/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/ssh", "/root", "/proc/kcore", "/run/secrets"]
}

test_sandbox_follows_vm_override if {
	overrides := {"build": {"fs": {"read_write": ["/workspace", "/srv/build"]}}}
	s := fs.sandbox with input as {"version": 1, "vm": "build"} with data.settings.vms as overrides
	s.read_write == ["/workspace", "/srv/build"]
	t := fs.sandbox with input as {"version": 1, "vm": "demo"} with data.settings.vms as overrides
	t.read_write == ["/workspace", "/home/agent", "/tmp"]
}

test_sandbox_roots_are_absolute_and_clean if {
	s := fs.sandbox with input as {"version": 1, "vm": "demo"}
	every path in array.concat(array.concat(s.read_write, s.read_only), s.denied) {
		clean(path)
	}
}

clean(path) if path == "/"

clean(path) if {
	startswith(path, "/")
	not endswith(path, "/")
	not contains(path, "//")
	every part in array.slice(split(path, "/"), 1, 100) {
		not part in {".", ".."}
	}
}

test_sandbox_agrees_with_decision if {
	s := fs.sandbox with input as {"version": 1, "vm": "demo"}
	every root in s.read_write {
		allowed_by(decide("write", concat("/", [root, "file"])), "carrel.fs.read_write_root")
	}
	every root in s.read_only {
		allowed_by(decide("read", concat("/", [root, "file"])), "carrel.fs.read_only_root")
		denied_by(decide("write", concat("/", [root, "file"])), "carrel.fs.default_deny")
	}
	every secret in s.denied {
		denied_by(decide("read", secret), "carrel.fs.secret_path")
		denied_by(decide("write", concat("/", [secret, "file"])), "carrel.fs.secret_path")
	}
}
