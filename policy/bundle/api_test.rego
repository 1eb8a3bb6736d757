package carrel.api_test

import data.carrel.api

peer(uid, gid) := {"type": "peer", "uid": uid, "gid": gid, "pid": 4242}

token(vm) := {"type": "token", "token_id": "tok-1", "vm": vm}

# call is procedure called by caller on vm; carreld runs as uid 990.
call(caller, procedure, vm) := {
	"version": 1,
	"caller": caller,
	"daemon_uid": 990,
	"procedure": procedure,
	"vm": vm,
}

decide(caller, procedure, vm) := d if {
	d := api.decision with input as call(caller, procedure, vm)
}

allowed_by(d, rule) if {
	d.allow == true
	d.rule == rule
}

denied_by(d, rule) if {
	d.allow == false
	d.rule == rule
}

procedures_of(class) := {p | some p, c in api.procedures; c == class}

# Operators.

test_root_may_call_every_procedure if {
	every procedure, _ in api.procedures {
		allowed_by(decide(peer(0, 0), procedure, "demo"), "carrel.api.operator")
	}
}

test_daemon_user_is_an_operator if {
	d := decide(peer(990, 990), "/carrel.api.v1.VMService/CreateVM", "demo")
	allowed_by(d, "carrel.api.operator")
	d.reason == "uid 990 gid 990 (pid 4242) is an operator"
}

test_other_local_users_denied if {
	every procedure in ["/carrel.api.v1.VMService/CreateVM", "/carrel.api.v1.VMService/ListVMs", "/carrel.agent.v1.FileService/Read"] {
		d := decide(peer(1000, 1000), procedure, "demo")
		denied_by(d, "carrel.api.default_deny")
		d.reason == "uid 1000 gid 1000 (pid 4242) is not an operator and holds no token"
	}
}

test_operator_uids if {
	allowed_by(decide(peer(1000, 1000), "/carrel.api.v1.VMService/DeleteVM", "demo"), "carrel.api.operator") with data.settings.api.operator_uids as [1000]
	denied_by(decide(peer(1001, 1000), "/carrel.api.v1.VMService/DeleteVM", "demo"), "carrel.api.default_deny") with data.settings.api.operator_uids as [1000]
}

test_operator_gids if {
	allowed_by(decide(peer(1000, 27), "/carrel.api.v1.VMService/StopVM", "demo"), "carrel.api.operator") with data.settings.api.operator_gids as [27]
	denied_by(decide(peer(1000, 1000), "/carrel.api.v1.VMService/StopVM", "demo"), "carrel.api.default_deny") with data.settings.api.operator_gids as [27]
}

test_operator_may_call_without_a_vm if {
	allowed_by(decide(peer(0, 0), "/carrel.api.v1.VMService/ListVMs", ""), "carrel.api.operator")
}

# Tokens.

test_token_may_call_its_classes_on_its_vm if {
	every class in ["read", "exec", "files_read", "files_write", "ports", "audit"] {
		every procedure in procedures_of(class) {
			allowed_by(decide(token("demo"), procedure, "demo"), "carrel.api.token")
		}
	}
}

test_token_reason if {
	d := decide(token("demo"), "/carrel.agent.v1.FileService/Write", "demo")
	d.reason == "token tok-1 may call files_write procedures on VM demo"
}

test_token_may_not_call_admin_procedures if {
	every procedure in procedures_of("admin") {
		denied_by(decide(token("demo"), procedure, "demo"), "carrel.api.token_class")
	}
}

test_token_class_reason if {
	d := decide(token("demo"), "/carrel.api.v1.VMService/DeleteVM", "demo")
	d.reason == "token tok-1 may not call /carrel.api.v1.VMService/DeleteVM: its class, admin, is not in settings.api.token_classes"
}

test_token_may_not_act_on_another_vm if {
	d := decide(token("demo"), "/carrel.api.v1.VMService/Exec", "other")
	denied_by(d, "carrel.api.token_vm")
	d.reason == "token tok-1 is scoped to VM \"demo\"; /carrel.api.v1.VMService/Exec names VM \"other\""
}

test_token_may_read_its_vms_audit_records_unless_told_otherwise if {
	list := "/carrel.api.v1.VMService/ListAuditRecords"
	allowed_by(decide(token("demo"), list, "demo"), "carrel.api.token")
	denied_by(decide(token("demo"), list, "other"), "carrel.api.token_vm")
	denied_by(decide(token("demo"), list, "demo"), "carrel.api.token_class") with data.settings.api.token_classes as ["read"]
}

test_token_may_not_call_procedures_naming_no_vm if {
	denied_by(decide(token("demo"), "/carrel.api.v1.VMService/ListVMs", ""), "carrel.api.token_vm")
	denied_by(decide(token("demo"), "/carrel.api.v1.SystemService/GetInfo", ""), "carrel.api.token_vm")
}

test_token_without_a_vm_denied if {
	denied_by(decide(token(""), "/carrel.api.v1.VMService/GetVM", ""), "carrel.api.token_vm")
	denied_by(decide(token(""), "/carrel.api.v1.VMService/GetVM", "demo"), "carrel.api.token_vm")
}

test_token_classes_setting if {
	classes := ["read", "exec", "files_read", "ports"]
	denied_by(decide(token("demo"), "/carrel.agent.v1.FileService/Write", "demo"), "carrel.api.token_class") with data.settings.api.token_classes as classes
	allowed_by(decide(token("demo"), "/carrel.agent.v1.FileService/Read", "demo"), "carrel.api.token") with data.settings.api.token_classes as classes
}

test_token_holder_is_never_an_operator if {
	d := api.decision with input as call({"type": "token", "token_id": "tok-1", "vm": "demo", "uid": 0}, "/carrel.api.v1.VMService/CreateVM", "demo")
	denied_by(d, "carrel.api.token_class")
}

# Unknown procedures and callers.

test_unknown_procedures_denied_even_to_root if {
	every procedure in [
		"/carrel.agent.v1.AgentService/Nope",
		"/carrel.api.v1.PolicyService/TestPolicy",
		"/carrel.api.v1.VMService/Nope",
		"/carrel.api.v1.VMService/createvm",
		"",
		"/",
	] {
		d := decide(peer(0, 0), procedure, "demo")
		denied_by(d, "carrel.api.unknown_procedure")
		d.reason == concat("", [procedure, " is not a procedure carreld serves"])
	}
}

test_unknown_caller_type_denied if {
	d := api.decision with input as call({"type": "ghost", "uid": 0}, "/carrel.api.v1.VMService/ListVMs", "")
	denied_by(d, "carrel.api.default_deny")
	d.reason == "a caller of type ghost is not an operator and holds no token"
}

test_decision_defined_for_any_input if {
	every doc in [
		{},
		{"procedure": "/carrel.api.v1.VMService/ListVMs"},
		{"procedure": "/carrel.api.v1.VMService/ListVMs", "caller": {"type": "peer"}},
		{"caller": {"type": "peer", "uid": 0, "gid": 0, "pid": 1}},
		{"procedure": "/carrel.api.v1.VMService/GetVM", "caller": {"type": "token", "token_id": "t", "vm": "demo"}},
		{"procedure": "/carrel.api.v1.VMService/GetVM", "vm": "demo", "caller": {"type": "token"}},
		{"procedure": "/carrel.api.v1.VMService/GetVM", "vm": "demo", "caller": {"type": "peer", "gid": 0}},
	] {
		d := api.decision with input as doc
		d.allow == false
		startswith(d.rule, "carrel.api.")
	}
}

# Per-VM overrides.

test_vm_override_narrows_token_classes if {
	overrides := {"prod": {"api": {"token_classes": ["read"]}}}
	prod := decide(token("prod"), "/carrel.api.v1.VMService/Exec", "prod") with data.settings.vms as overrides
	denied_by(prod, "carrel.api.token_class")
	allowed_by(decide(token("demo"), "/carrel.api.v1.VMService/Exec", "demo"), "carrel.api.token") with data.settings.vms as overrides
}

test_vm_override_adds_an_operator_for_one_vm if {
	overrides := {"team": {"api": {"operator_uids": [1000]}}}
	allowed_by(decide(peer(1000, 1000), "/carrel.api.v1.VMService/StopVM", "team"), "carrel.api.operator") with data.settings.vms as overrides
	denied_by(decide(peer(1000, 1000), "/carrel.api.v1.VMService/StopVM", "demo"), "carrel.api.default_deny") with data.settings.vms as overrides
}

# The procedure table.

test_procedure_classes_are_known if {
	every _, class in api.procedures {
		class in {"read", "admin", "exec", "files_read", "files_write", "ports", "snapshot", "audit"}
	}
}

test_procedure_classes if {
	api.procedures["/carrel.api.v1.VMService/CreateVM"] == "admin"
	api.procedures["/carrel.api.v1.VMService/Exec"] == "exec"
	api.procedures["/carrel.api.v1.VMService/ListVMs"] == "read"
	api.procedures["/carrel.api.v1.ImageService/BuildImage"] == "admin"
	api.procedures["/carrel.api.v1.ImageService/ListImages"] == "read"
	api.procedures["/carrel.api.v1.ImageService/InspectImage"] == "read"
	api.procedures["/carrel.api.v1.ImageService/ImportImage"] == "admin"
	api.procedures["/carrel.api.v1.VMService/ResetVM"] == "admin"
	api.procedures["/carrel.api.v1.VMService/PauseVM"] == "snapshot"
	api.procedures["/carrel.api.v1.SystemService/GetInfo"] == "read"
	api.procedures["/carrel.api.v1.PolicyService/ApplyPolicy"] == "admin"
	api.procedures["/carrel.api.v1.PolicyService/EvalPolicy"] == "read"
	api.procedures["/carrel.api.v1.TokenService/CreateToken"] == "admin"
	api.procedures["/carrel.api.v1.TokenService/ListTokens"] == "admin"
	api.procedures["/carrel.agent.v1.AgentService/Health"] == "read"
	api.procedures["/carrel.agent.v1.AgentService/Process"] == "exec"
	api.procedures["/carrel.agent.v1.AgentService/Signal"] == "exec"
	api.procedures["/carrel.agent.v1.FileService/Read"] == "files_read"
	api.procedures["/carrel.agent.v1.FileService/ReadTar"] == "files_read"
	api.procedures["/carrel.agent.v1.FileService/Watch"] == "files_read"
	api.procedures["/carrel.agent.v1.FileService/WriteTar"] == "files_write"
	api.procedures["/carrel.agent.v1.FileService/Chown"] == "files_write"
	api.procedures["/carrel.agent.v1.PortService/Connect"] == "ports"
}

# carreld refuses to relay these; as admin, tokens are denied before that.
test_shutdown_and_set_sandbox_are_admin if {
	api.procedures["/carrel.agent.v1.AgentService/Shutdown"] == "admin"
	api.procedures["/carrel.agent.v1.AgentService/SetSandbox"] == "admin"
	api.procedures["/carrel.agent.v1.AgentService/Activity"] == "admin"
	denied_by(decide(token("demo"), "/carrel.agent.v1.AgentService/SetSandbox", "demo"), "carrel.api.token_class")
	denied_by(decide(token("demo"), "/carrel.agent.v1.AgentService/Activity", "demo"), "carrel.api.token_class")
}

# carreld's egress calls into the guest are not on its API; classified
# admin all the same, so that no token could ever reach them.
test_egress_service_is_admin if {
	api.procedures["/carrel.agent.v1.EgressService/Requests"] == "admin"
	api.procedures["/carrel.agent.v1.EgressService/Connect"] == "admin"
	denied_by(decide(token("demo"), "/carrel.agent.v1.EgressService/Connect", "demo"), "carrel.api.token_class")
}

test_operator_groups if {
	member := object.union(peer(1000, 1000), {"groups": ["users", "carrel"]})
	allowed_by(decide(member, "/carrel.api.v1.VMService/StopVM", "demo"), "carrel.api.operator")
	outsider := object.union(peer(1000, 1000), {"groups": ["users"]})
	denied_by(decide(outsider, "/carrel.api.v1.VMService/StopVM", "demo"), "carrel.api.default_deny")
	denied_by(decide(member, "/carrel.api.v1.VMService/StopVM", "demo"), "carrel.api.default_deny") with data.settings.api.operator_groups as []
}

# API keys.

key(name, scope) := {"type": "key", "key_id": "0123456789abcdef", "name": name, "images": ["agent"], "policy": "", "vm": scope}

create(caller, vm, image, vm_policy) := d if {
	d := api.decision with input as object.union(call(caller, "/carrel.api.v1.VMService/CreateVM", vm), {"image": image, "vm_policy": vm_policy})
}

test_key_acts_on_its_own_vms if {
	every procedure in ["/carrel.api.v1.VMService/DeleteVM", "/carrel.api.v1.VMService/SetVMExpiry", "/carrel.agent.v1.AgentService/Process", "/carrel.agent.v1.AgentService/Input", "/carrel.agent.v1.FileService/Write"] {
		allowed_by(decide(key("alice", ""), procedure, "e2b-alice-1a2b"), "carrel.api.key")
	}
	allowed_by(decide(key("alice", ""), "/carrel.api.v1.VMService/ListVMs", ""), "carrel.api.key")
}

test_key_denied_others_vms if {
	every vm in ["e2b-bob-1a2b", "demo", "e2b-alicex-1", "e2b-alice", ""] {
		d := decide(key("alice", ""), "/carrel.agent.v1.AgentService/Process", vm)
		denied_by(d, "carrel.api.key_vm")
	}
	d := decide(key("alice", ""), "/carrel.api.v1.VMService/DeleteVM", "e2b-bob-1")
	d.reason == "key alice (0123456789abcdef) acts only on its own VMs (named \"e2b-alice-\"...); /carrel.api.v1.VMService/DeleteVM names VM \"e2b-bob-1\""
}

test_key_admin_procedures_denied if {
	every procedure in ["/carrel.api.v1.PolicyService/ApplyPolicy", "/carrel.api.v1.TokenService/CreateToken", "/carrel.api.v1.VMService/ForkVM", "/carrel.api.v1.ImageService/BuildImage", "/carrel.agent.v1.AgentService/Shutdown"] {
		denied_by(decide(key("alice", ""), procedure, "e2b-alice-1"), "carrel.api.key_procedure")
	}
}

test_key_classes_setting if {
	denied_by(decide(key("alice", ""), "/carrel.agent.v1.FileService/Write", "e2b-alice-1"), "carrel.api.key_procedure") with data.settings.api.key_classes as ["read"]
	allowed_by(decide(key("alice", ""), "/carrel.api.v1.VMService/DeleteVM", "e2b-alice-1"), "carrel.api.key") with data.settings.api.key_classes as []
}

test_sandbox_token_one_vm_no_lifecycle if {
	allowed_by(decide(key("alice", "e2b-alice-1"), "/carrel.agent.v1.AgentService/Process", "e2b-alice-1"), "carrel.api.key")
	denied_by(decide(key("alice", "e2b-alice-1"), "/carrel.agent.v1.AgentService/Process", "e2b-alice-2"), "carrel.api.key_vm")
	denied_by(decide(key("alice", "e2b-alice-1"), "/carrel.api.v1.VMService/DeleteVM", "e2b-alice-1"), "carrel.api.key_procedure")
}

test_key_creates_its_images_under_its_policy if {
	allowed_by(create(key("alice", ""), "e2b-alice-1", "agent", ""), "carrel.api.key")
	allowed_by(create(key("alice", ""), "e2b-alice-1", "agent", "default"), "carrel.api.key")
	denied_by(create(key("alice", ""), "e2b-alice-1", "dev", ""), "carrel.api.key_create")
	denied_by(create(key("alice", ""), "e2b-alice-1", "agent", "open"), "carrel.api.key_create")
	denied_by(create(key("alice", ""), "bob", "agent", ""), "carrel.api.key_vm")
	allowed_by(create(object.union(key("alice", ""), {"images": ["*"]}), "e2b-alice-1", "dev", ""), "carrel.api.key")
}

test_key_never_gets_gpus if {
	doc := object.union(call(key("alice", ""), "/carrel.api.v1.VMService/CreateVM", "e2b-alice-1"), {"image": "agent", "gpus": ["0000:41:00.0"]})
	d := api.decision with input as doc with data.settings.gpu.allow as true
	denied_by(d, "carrel.api.key_create")
}

test_key_starts_no_gpu_vm_the_gpu_rules_deny if {
	d := api.decision with input as object.union(call(key("alice", ""), "/carrel.api.v1.VMService/StartVM", "e2b-alice-1"), {"gpus": ["0000:41:00.0"]})
	d.allow == false
}
