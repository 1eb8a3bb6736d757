package carrel.api_gpu_test

import data.carrel.api

create := "/carrel.api.v1.VMService/CreateVM"

start := "/carrel.api.v1.VMService/StartVM"

root := {"type": "peer", "uid": 0, "gid": 0, "pid": 4242}

# call is caller giving vm gpus through procedure; carreld runs as uid 990.
call(caller, procedure, vm, gpus) := {
	"version": 1,
	"caller": caller,
	"daemon_uid": 990,
	"procedure": procedure,
	"vm": vm,
	"gpus": gpus,
}

decide(procedure, vm, gpus) := d if {
	d := api.decision with input as call(root, procedure, vm, gpus)
}

gpu := "0000:41:00.0"

# The default: no VM gets a GPU, and the reason says what to set.
test_default_gives_no_vm_a_gpu if {
	every procedure in [create, start] {
		d := decide(procedure, "train", [gpu])
		d.allow == false
		d.rule == "carrel.api.gpu_vm"
		d.reason == `VM "train" may not be given GPUs (0000:41:00.0): settings.gpu.allowed_vms does not name it, and settings.vms["train"].gpu.allow is not true`
	}
}

# A call without GPUs is untouched by the GPU rules.
test_no_gpus_no_gpu_rule if {
	d := api.decision with input as {"version": 1, "caller": root, "daemon_uid": 990, "procedure": create, "vm": "train"}
	d.allow
	d.rule == "carrel.api.operator"
	d2 := decide(create, "train", [])
	d2.allow
}

test_allowed_vms if {
	d := decide(create, "train", [gpu]) with data.settings.gpu.allowed_vms as ["train"]
	d.allow
	d.rule == "carrel.api.operator"
	other := decide(create, "other", [gpu]) with data.settings.gpu.allowed_vms as ["train"]
	other.rule == "carrel.api.gpu_vm"
}

test_per_vm_override if {
	d := decide(create, "train", [gpu]) with data.settings.vms as {"train": {"gpu": {"allow": true}}}
	d.allow

	# An override of false beats allowed_vms.
	d2 := decide(start, "train", [gpu]) with data.settings.vms as {"train": {"gpu": {"allow": false}}}
		with data.settings.gpu.allowed_vms as ["train"]
	d2.allow == false
	d2.rule == "carrel.api.gpu_vm"
	contains(d2.reason, "gpu.allow is false")
}

test_devices if {
	settings := {"allowed_vms": ["train"], "devices": ["0000:41:00.0"]}
	d := decide(create, "train", [gpu]) with data.settings.gpu as settings
	d.allow
	d2 := decide(create, "train", [gpu, "0000:61:00.0"]) with data.settings.gpu as settings
	d2.allow == false
	d2.rule == "carrel.api.gpu_device"
	d2.reason == `VM "train" may not be given 0000:61:00.0: not in settings.gpu.devices`

	# Per VM: this VM may have this GPU only.
	d3 := decide(create, "train", ["0000:61:00.0"]) with data.settings.vms as {"train": {"gpu": {"allow": true, "devices": [gpu]}}}
	d3.rule == "carrel.api.gpu_device"
	d4 := decide(create, "infer", ["0000:61:00.0"]) with data.settings.vms as {"infer": {"gpu": {"allow": true}}}
	d4.allow
}

# A data-only policy written before GPUs (no settings.gpu) gives none.
test_settings_without_gpu if {
	d := decide(create, "train", [gpu]) with data.settings as {"api": data.settings.api, "vms": {}}
	d.rule == "carrel.api.gpu_vm"
	d2 := decide(create, "train", [gpu]) with data.settings as {"api": data.settings.api, "vms": {"train": {"gpu": {"allow": true}}}}
	d2.rule == "carrel.api.gpu_device"
}

# Who may not make the call at all is told so, not about GPUs.
test_non_operator_gets_default_deny if {
	d := api.decision with input as call({"type": "peer", "uid": 1000, "gid": 1000, "pid": 1}, create, "train", [gpu])
	d.rule == "carrel.api.default_deny"
	t := api.decision with input as call({"type": "token", "token_id": "t", "vm": "train"}, create, "train", [gpu])
	t.rule == "carrel.api.token_class"
}

# A token whose class list includes admin, on its VM: the GPU rules hold
# for it too.
test_token_gpu_rules if {
	tok := {"type": "token", "token_id": "t", "vm": "train"}
	d := api.decision with input as call(tok, start, "train", [gpu])
		with data.settings.api.token_classes as ["admin"]
	d.rule == "carrel.api.gpu_vm"
	d2 := api.decision with input as call(tok, start, "train", [gpu])
		with data.settings.api.token_classes as ["admin"]
		with data.settings.gpu.allowed_vms as ["train"]
	d2.rule == "carrel.api.token"
}

test_list_gpus_is_read if {
	api.procedures["/carrel.api.v1.GPUService/ListGPUs"] == "read"
}
