# Tests for the locked-down example: the default rules with this
# directory's data.json.
package carrel.examples.locked_down_test

import data.carrel.exec
import data.carrel.fs
import data.carrel.guest
import data.carrel.net

file(operation, path) := d if {
	d := fs.decision with input as {
		"version": 1, "vm": "demo",
		"caller": {"type": "token", "token_id": "tok-1", "vm": "demo"},
		"operation": operation, "path": path, "recursive": false,
	}
}

run(argv) := d if {
	d := exec.decision with input as {
		"version": 1, "vm": "demo",
		"caller": {"type": "token", "token_id": "tok-1", "vm": "demo"},
		"argv": argv, "env": {}, "cwd": "/workspace", "user": "agent", "tty": false,
	}
}

test_workspace_is_the_only_writable_root if {
	d := file("write", "/workspace/main.go")
	d.allow == true
	every path in ["/tmp/x", "/home/agent/x", "/var/tmp/x"] {
		denied := file("write", path)
		denied.allow == false
	}
}

test_tmp_not_even_readable if {
	d := file("read", "/tmp/x")
	d.allow == false
	d.rule == "carrel.fs.default_deny"
}

test_sandbox_matches if {
	s := fs.sandbox with input as {"version": 1, "vm": "demo"}
	s.read_write == ["/workspace"]
	not "/tmp" in s.read_only
}

test_network_tools_denied if {
	every argv in [["curl", "https://example.com"], ["/usr/bin/wget", "x"], ["nc", "-l", "80"], ["ssh", "host"], ["scp", "a", "b:"]] {
		d := run(argv)
		d.allow == false
		d.rule == "carrel.exec.denied_command"
	}
}

test_ordinary_commands_allowed if {
	d := run(["go", "test", "./..."])
	d.allow == true
}

test_no_forward_no_egress if {
	forward := net.decision with input as {"version": 1, "vm": "demo", "direction": "forward", "host": "localhost", "port": 8080, "protocol": "tcp"}
	forward.allow == false
	egress := net.decision with input as {"version": 1, "vm": "demo", "direction": "egress", "host": "pypi.org", "port": 443, "protocol": "tcp"}
	egress.allow == false
}

test_no_guest_requests if {
	d := guest.decision with input as {"version": 1, "vm": "demo", "request": "checkpoint", "args": {}}
	d.allow == false
}
