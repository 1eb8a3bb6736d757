# Tests for the analyst example: the default rules with this directory's
# data.json.
package carrel.examples.analyst_test

import data.carrel.api
import data.carrel.exec
import data.carrel.fs
import data.carrel.net

file(operation, path) := d if {
	d := fs.decision with input as {
		"version": 1, "vm": "demo",
		"caller": {"type": "token", "token_id": "tok-1", "vm": "demo"},
		"operation": operation, "path": path, "recursive": false,
	}
}

procedure(name) := d if {
	d := api.decision with input as {
		"version": 1, "daemon_uid": 0, "vm": "demo",
		"caller": {"type": "token", "token_id": "tok-1", "vm": "demo"},
		"procedure": name,
	}
}

test_workspace_is_read_only if {
	every operation in ["read", "list", "watch"] {
		d := file(operation, "/workspace/data/sales.csv")
		d.allow == true
		d.rule == "carrel.fs.read_only_root"
	}
	every operation in ["write", "create", "delete", "chmod"] {
		d := file(operation, "/workspace/data/sales.csv")
		d.allow == false
		d.rule == "carrel.fs.default_deny"
	}
}

test_tmp_is_the_only_scratch_space if {
	d := file("write", "/tmp/out.parquet")
	d.allow == true
	d.rule == "carrel.fs.read_write_root"
	home := file("write", "/home/agent/x")
	home.allow == false
}

test_sandbox_matches if {
	s := fs.sandbox with input as {"version": 1, "vm": "demo"}
	s.read_write == ["/tmp"]
	"/workspace" in s.read_only
}

test_tokens_may_read_but_not_write_files if {
	read := procedure("/carrel.agent.v1.FileService/Read")
	read.allow == true
	every name in ["/carrel.agent.v1.FileService/Write", "/carrel.agent.v1.FileService/WriteTar", "/carrel.agent.v1.FileService/Remove"] {
		d := procedure(name)
		d.allow == false
		d.rule == "carrel.api.token_class"
	}
}

test_tokens_may_still_run_commands if {
	d := procedure("/carrel.api.v1.VMService/Exec")
	d.allow == true
	e := exec.decision with input as {
		"version": 1, "vm": "demo",
		"caller": {"type": "token", "token_id": "tok-1", "vm": "demo"},
		"argv": ["python3", "report.py"], "env": {}, "cwd": "/workspace", "user": "agent", "tty": false,
	}
	e.allow == true
}

test_no_egress if {
	every host in ["pypi.org", "github.com", "example.com"] {
		d := net.decision with input as {"version": 1, "vm": "demo", "direction": "egress", "host": host, "port": 443, "protocol": "tcp"}
		d.allow == false
	}
}
