# carrel.api decides every call to carreld's API, relayed agent calls
# included, before carreld acts on it or forwards it to a VM.
#
# Input (version 1):
#   {"version": 1, "procedure": "/carrel.api.v1.VMService/Exec", "vm": "demo",
#    "daemon_uid": 0, "caller": {"type": "peer", "uid": 1000, "gid": 1000, "pid": 4242}}
# caller is a local process, {"type": "peer", "uid", "gid", "pid"} from
# SO_PEERCRED, or a bearer token, {"type": "token", "token_id", "vm"},
# where vm is the one VM the token may act on, or an API key,
# {"type": "key", "key_id", "name", "images", "policy", "vm"} (see the key
# rules below). CreateVM's input also has "image" and, when set,
# "vm_policy": what the new VM would boot and be bound to. vm is the VM the call names,
# or "" when it names none. daemon_uid is carreld's own uid.
# gpus is there only when the call would give its VM GPUs (CreateVM with
# GPUs, or StartVM of a VM created with them): their PCI addresses in the
# kernel's spelling, sorted, e.g. "gpus": ["0000:41:00.0"].
#
# Every list of uids, gids and classes lives in data.json under settings.api.
package carrel.api

# settings is data.settings.api, with data.settings.vms[NAME].api merged
# over it when this VM has overrides. An override replaces each list it
# names as a whole.
settings := object.union(data.settings.api, overrides) if {
	overrides := data.settings.vms[input.vm].api
} else := data.settings.api

# procedures classifies every procedure carreld serves. A procedure that is
# not here is denied, for everyone.
procedures := {
	# carreld's own services.
	"/carrel.api.v1.VMService/CreateVM": "admin",
	"/carrel.api.v1.VMService/GetVM": "read",
	"/carrel.api.v1.VMService/ListVMs": "read",
	"/carrel.api.v1.VMService/StartVM": "admin",
	"/carrel.api.v1.VMService/StopVM": "admin",
	"/carrel.api.v1.VMService/DeleteVM": "admin",
	"/carrel.api.v1.VMService/ResetVM": "admin",
	"/carrel.api.v1.VMService/PauseVM": "snapshot",
	"/carrel.api.v1.VMService/ResumeVM": "snapshot",
	"/carrel.api.v1.VMService/SnapshotVM": "snapshot",
	"/carrel.api.v1.VMService/ListSnapshots": "read",
	"/carrel.api.v1.VMService/RestoreVM": "snapshot",
	"/carrel.api.v1.VMService/DeleteSnapshot": "snapshot",
	"/carrel.api.v1.VMService/ForkVM": "admin",
	"/carrel.api.v1.VMService/SetVMExpiry": "admin",
	"/carrel.api.v1.VMService/Exec": "exec",
	"/carrel.api.v1.VMService/GetConsole": "read",
	"/carrel.api.v1.VMService/ListAuditRecords": "audit",
	"/carrel.api.v1.ImageService/BuildImage": "admin",
	"/carrel.api.v1.ImageService/ListImages": "read",
	"/carrel.api.v1.ImageService/InspectImage": "read",
	"/carrel.api.v1.ImageService/ImportImage": "admin",
	"/carrel.api.v1.SystemService/GetInfo": "read",
	"/carrel.api.v1.SystemService/GetCaller": "read",
	"/carrel.api.v1.GPUService/ListGPUs": "read",
	"/carrel.api.v1.PolicyService/ApplyPolicy": "admin",
	"/carrel.api.v1.PolicyService/GetPolicy": "read",
	"/carrel.api.v1.PolicyService/ListPolicies": "read",
	"/carrel.api.v1.PolicyService/CheckPolicy": "read",
	"/carrel.api.v1.PolicyService/EvalPolicy": "read",
	"/carrel.api.v1.PolicyService/ListDecisions": "read",
	"/carrel.api.v1.TokenService/CreateToken": "admin",
	"/carrel.api.v1.TokenService/ListTokens": "admin",
	"/carrel.api.v1.TokenService/RevokeToken": "admin",
	# The agent's services, relayed to the VM the call names.
	"/carrel.agent.v1.AgentService/Health": "read",
	"/carrel.agent.v1.AgentService/Exec": "exec",
	"/carrel.agent.v1.AgentService/Process": "exec",
	"/carrel.agent.v1.AgentService/ListProcesses": "exec",
	"/carrel.agent.v1.AgentService/Signal": "exec",
	"/carrel.agent.v1.AgentService/Input": "exec",
	# carreld's own business: its handlers refuse to relay these, whoever asks.
	"/carrel.agent.v1.AgentService/Shutdown": "admin",
	"/carrel.agent.v1.AgentService/SetSandbox": "admin",
	"/carrel.agent.v1.AgentService/Activity": "admin",
	"/carrel.agent.v1.AgentService/Restored": "admin",
	"/carrel.agent.v1.AgentService/GuestRequests": "admin",
	"/carrel.agent.v1.AgentService/AnswerGuestRequest": "admin",
	"/carrel.agent.v1.AgentService/Commands": "admin",
	"/carrel.agent.v1.FileService/Stat": "files_read",
	"/carrel.agent.v1.FileService/List": "files_read",
	"/carrel.agent.v1.FileService/Read": "files_read",
	"/carrel.agent.v1.FileService/ReadTar": "files_read",
	"/carrel.agent.v1.FileService/Watch": "files_read",
	"/carrel.agent.v1.FileService/Write": "files_write",
	"/carrel.agent.v1.FileService/WriteTar": "files_write",
	"/carrel.agent.v1.FileService/MakeDir": "files_write",
	"/carrel.agent.v1.FileService/Remove": "files_write",
	"/carrel.agent.v1.FileService/Rename": "files_write",
	"/carrel.agent.v1.FileService/Chmod": "files_write",
	"/carrel.agent.v1.FileService/Chown": "files_write",
	"/carrel.agent.v1.PortService/Connect": "ports",
	# carreld's own calls into the guest for egress: not on its API at all.
	"/carrel.agent.v1.EgressService/Requests": "admin",
	"/carrel.agent.v1.EgressService/Connect": "admin",
}

default procedure := ""

procedure := input.procedure

default vm := ""

vm := input.vm

# class is the procedure's class; undefined for an unknown procedure.
class := procedures[procedure]

# decision is always defined: an input too malformed for the rules below
# gets this.
default decision := {
	"allow": false,
	"rule": "carrel.api.default_deny",
	"reason": "malformed input",
}

# The two allows come first, as the common case. Each states every
# condition it needs, and those rule out every deny below, so an allow
# never hides a deny. Each branch that is about one caller type tests it
# first: OPA then skips the branches for other types without evaluating
# them.
decision := {
	"allow": true,
	"rule": "carrel.api.token",
	"reason": concat("", [who, " may call ", procedure_class, " procedures on VM ", input.vm]),
} if {
	input.caller.type == "token"
	procedure_class := procedures[input.procedure]
	procedure_class in settings.token_classes
	input.caller.vm != "" # token_on_its_vm, spelled out
	input.caller.vm == input.vm
	gpus_allowed
} else := {
	"allow": true,
	"rule": "carrel.api.operator",
	"reason": concat("", [who, " is an operator"]),
} if {
	input.caller.type == "peer"
	procedures[input.procedure] # a known procedure
	operator
	gpus_allowed
} else := {
	"allow": true,
	"rule": "carrel.api.key",
	"reason": concat("", [who, " may call ", procedure, key_on_what]),
} if {
	input.caller.type == "key"
	key_may_call
	gpus_allowed
} else := {
	"allow": false,
	"rule": "carrel.api.unknown_procedure",
	"reason": concat("", [procedure, " is not a procedure carreld serves"]),
} if {
	not class
} else := {
	"allow": false,
	"rule": "carrel.api.token_class",
	"reason": concat("", [who, " may not call ", procedure, ": its class, ", class, ", is not in settings.api.token_classes"]),
} if {
	input.caller.type == "token"
	not class in settings.token_classes
} else := {
	"allow": false,
	"rule": "carrel.api.token_vm",
	"reason": sprintf("%s is scoped to VM %q; %s names VM %q", [who, object.get(input.caller, "vm", ""), procedure, vm]),
} if {
	input.caller.type == "token"
	not token_on_its_vm
} else := {
	"allow": false,
	"rule": "carrel.api.key_procedure",
	"reason": concat("", [who, " may not call ", procedure, key_procedure_refusal]),
} if {
	input.caller.type == "key"
	not key_procedure_ok
} else := {
	"allow": false,
	"rule": "carrel.api.key_vm",
	"reason": sprintf("%s acts only on its own VMs (named %q...%s); %s names VM %q", [who, key_prefix, key_scope_text, procedure, vm]),
} if {
	input.caller.type == "key"
	not key_vm_ok
} else := {
	"allow": false,
	"rule": "carrel.api.key_create",
	"reason": sprintf("%s may create VMs of images %v under policy %q, without GPUs; this one would boot %q under %q%s", [who, input.caller.images, key_policy(input.caller.policy), object.get(input, "image", ""), key_policy(object.get(input, "vm_policy", "")), key_gpu_text]),
} if {
	input.caller.type == "key"
	not key_create_ok
} else := {
	"allow": false,
	"rule": "carrel.api.gpu_vm",
	"reason": sprintf("VM %q may not be given GPUs (%s): %s", [vm, concat(", ", requested_gpus), gpu_vm_refusal]),
} if {
	count(requested_gpus) > 0
	caller_may_call
	not vm_may_have_gpus
} else := {
	"allow": false,
	"rule": "carrel.api.gpu_device",
	"reason": sprintf("VM %q may not be given %s: not in settings.gpu.devices", [vm, concat(", ", gpus_not_allowed)]),
} if {
	count(gpus_not_allowed) > 0
	caller_may_call
} else := {
	"allow": false,
	"rule": "carrel.api.default_deny",
	"reason": concat("", [who, " is not an operator and holds no token"]),
}

# operator is true for a local process of root, of carreld's own user, of
# a uid or gid in settings.api.operator_uids or operator_gids, or in a group
# named in settings.api.operator_groups (primary or supplementary; carreld
# reads them with SO_PEERGROUPS when the process connects).
operator if {
	input.caller.type == "peer"
	input.caller.uid == 0
}

operator if {
	input.caller.type == "peer"
	input.caller.uid == input.daemon_uid
}

operator if {
	input.caller.type == "peer"
	input.caller.uid in settings.operator_uids
}

operator if {
	input.caller.type == "peer"
	input.caller.gid in settings.operator_gids
}

operator if {
	input.caller.type == "peer"
	some group in object.get(input.caller, "groups", [])
	group in object.get(settings, "operator_groups", [])
}

# A token acts only on the VM it was issued for, and only in calls that
# name that VM.
token_on_its_vm if {
	input.caller.vm != ""
	input.caller.vm == vm
}

# API keys. A key names an identity (caller.name) that creates VMs of
# its own, named "e2b-NAME-...", and acts on those alone: lifecycle calls
# (key_lifecycle), and the classes in settings.api.key_classes. A sandbox
# token of a key (caller.vm set) acts on that one VM, and on no
# lifecycle call. A key creates VMs only of the images it names ("*": any),
# under the policy it names ("" is "default"), and never with GPUs.
key_lifecycle := {
	"/carrel.api.v1.VMService/CreateVM",
	"/carrel.api.v1.VMService/StartVM",
	"/carrel.api.v1.VMService/StopVM",
	"/carrel.api.v1.VMService/DeleteVM",
	"/carrel.api.v1.VMService/SetVMExpiry",
}

key_classes := object.get(settings, "key_classes", ["read", "exec", "files_read", "files_write", "ports", "audit", "snapshot"])

key_prefix := concat("", ["e2b-", object.get(input.caller, "name", ""), "-"])

key_may_call if {
	key_procedure_ok
	key_vm_ok
	key_create_ok
}

key_procedure_ok if {
	procedures[input.procedure] in key_classes
}

key_procedure_ok if {
	input.procedure in key_lifecycle
	input.caller.vm == ""
}

key_procedure_refusal := " (a sandbox token makes no lifecycle calls)" if {
	input.procedure in key_lifecycle
} else := concat("", [": its class, ", class, ", is not in settings.api.key_classes"]) if {
	class
} else := ""

# ListVMs names no VM: its handler lists the key's own alone.
key_vm_ok if {
	input.procedure == "/carrel.api.v1.VMService/ListVMs"
	vm == ""
}

key_vm_ok if {
	startswith(vm, key_prefix)
	key_scope_ok
}

key_scope_ok if input.caller.vm == ""

key_scope_ok if input.caller.vm == vm

key_scope_text := sprintf(", and this token only %q", [input.caller.vm]) if {
	input.caller.vm != ""
} else := ""

key_create_ok if input.procedure != "/carrel.api.v1.VMService/CreateVM"

key_create_ok if {
	input.procedure == "/carrel.api.v1.VMService/CreateVM"
	key_image_ok
	key_policy(input.caller.policy) == key_policy(object.get(input, "vm_policy", ""))
	count(requested_gpus) == 0
}

key_image_ok if "*" in input.caller.images

key_image_ok if object.get(input, "image", "") in input.caller.images

key_policy(p) := "default" if {
	p == ""
} else := p

key_gpu_text := sprintf(" with GPUs %v", [requested_gpus]) if {
	count(requested_gpus) > 0
} else := ""

key_on_what := concat("", [" on its VM ", vm]) if {
	vm != ""
} else := " (listing its own VMs)"

# who names the caller in reasons.
who := sprintf("uid %v gid %v (pid %v)", [input.caller.uid, input.caller.gid, input.caller.pid]) if {
	input.caller.type == "peer"
} else := concat("", ["token ", input.caller.token_id]) if {
	input.caller.type == "token"
} else := sprintf("key %s (%s)", [input.caller.name, input.caller.key_id]) if {
	input.caller.type == "key"
} else := sprintf("a caller of type %v", [object.get(input, ["caller", "type"], "none")])

# caller_may_call is true when one of the allows above holds, GPUs aside:
# the GPU denies are for callers who could otherwise make the call.
caller_may_call if {
	input.caller.type == "token"
	procedures[input.procedure] in settings.token_classes
	token_on_its_vm
}

caller_may_call if {
	input.caller.type == "peer"
	procedures[input.procedure]
	operator
}

# GPUs. Policy decides which VMs may be given GPUs, and which GPUs: the
# settings are data.settings.gpu with data.settings.vms[NAME].gpu merged
# over it. Either may be missing (a data-only policy written before GPUs
# existed): then no VM gets a GPU.
gpu_settings := object.union(object.get(data.settings, "gpu", {}), object.get(data.settings, ["vms", vm, "gpu"], {}))

# requested_gpus are the GPUs the call would give its VM.
requested_gpus := object.get(input, "gpus", [])

# gpus_allowed: the call gives its VM no GPU, or only GPUs it may have.
gpus_allowed if count(requested_gpus) == 0

gpus_allowed if {
	vm_may_have_gpus
	count(gpus_not_allowed) == 0
}

# vm_may_have_gpus: gpu.allow decides when it is set (true or false; set
# it per VM under vms[NAME].gpu); otherwise the VM must be named in
# gpu.allowed_vms.
vm_may_have_gpus if gpu_settings.allow == true

vm_may_have_gpus if {
	not is_boolean(object.get(gpu_settings, "allow", null))
	vm in object.get(gpu_settings, "allowed_vms", [])
}

gpu_vm_refusal := sprintf("gpu.allow is false for it (settings.vms[%q].gpu.allow, or settings.gpu.allow)", [vm]) if {
	gpu_settings.allow == false
} else := sprintf("settings.gpu.allowed_vms does not name it, and settings.vms[%q].gpu.allow is not true", [vm])

# gpus_not_allowed are the requested GPUs gpu.devices does not name ("*"
# names every GPU).
gpus_not_allowed := [] if {
	"*" in object.get(gpu_settings, "devices", [])
} else := [gpu |
	some gpu in requested_gpus
	not gpu in object.get(gpu_settings, "devices", [])
]
