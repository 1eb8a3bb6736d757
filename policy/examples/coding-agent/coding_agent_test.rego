# Tests for the coding-agent example: the default rules with this
# directory's data.json.
package carrel.examples.coding_agent_test

import data.carrel.api
import data.carrel.exec
import data.carrel.fs
import data.carrel.net

egress(host, port) := d if {
	d := net.decision with input as {"version": 1, "vm": "demo", "direction": "egress", "host": host, "port": port, "protocol": "tcp"}
}

file(operation, path) := d if {
	d := fs.decision with input as {
		"version": 1, "vm": "demo",
		"caller": {"type": "token", "token_id": "tok-1", "vm": "demo"},
		"operation": operation, "path": path, "recursive": false,
	}
}

run(argv, user) := d if {
	d := exec.decision with input as {
		"version": 1, "vm": "demo",
		"caller": {"type": "token", "token_id": "tok-1", "vm": "demo"},
		"argv": argv, "env": {}, "cwd": "/workspace", "user": user, "tty": false,
	}
}

test_package_registries_reachable if {
	every host in ["registry.npmjs.org", "proxy.golang.org", "sum.golang.org", "pypi.org", "files.pythonhosted.org", "deb.debian.org", "github.com"] {
		d := egress(host, 443)
		d.allow == true
		d.rule == "carrel.net.egress_allow"
	}
}

test_only_https_port if {
	every host in ["registry.npmjs.org", "github.com", "deb.debian.org"] {
		d := egress(host, 80)
		d.allow == false
	}
}

test_other_hosts_unreachable if {
	every host in ["example.com", "api.github.com", "evil-registry.npmjs.org.attacker.net", "169.254.169.254"] {
		d := egress(host, 443)
		d.allow == false
		d.rule == "carrel.net.default_deny"
	}
}

test_commands_run_as_agent_only if {
	agent := run(["npm", "install"], "agent")
	agent.allow == true
	root := run(["apt-get", "install", "-y", "jq"], "root")
	root.allow == false
	root.rule == "carrel.exec.root_user"
}

test_home_writable_for_tool_caches if {
	d := file("write", "/home/agent/.cache/go-build/ab/cd")
	d.allow == true
	d.rule == "carrel.fs.read_write_root"
}

test_secrets_still_denied if {
	every path in ["/home/agent/.ssh/id_ed25519", "/workspace/.env", "/home/agent/.aws/credentials", "/etc/shadow"] {
		d := file("read", path)
		d.allow == false
		d.rule == "carrel.fs.secret_path"
	}
}

test_tokens_may_write_files if {
	d := api.decision with input as {
		"version": 1, "daemon_uid": 0, "vm": "demo",
		"caller": {"type": "token", "token_id": "tok-1", "vm": "demo"},
		"procedure": "/carrel.agent.v1.FileService/Write",
	}
	d.allow == true
}
