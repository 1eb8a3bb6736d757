package carrel.guest_test

import data.carrel.guest

guest_input(vm, request) := {"version": 1, "vm": vm, "request": request, "args": {}}

test_requests_denied_by_default if {
	every request in ["checkpoint", "shutdown", "egress", ""] {
		d := guest.decision with input as guest_input("demo", request)
		d.allow == false
		d.rule == "carrel.guest.default_deny"
		d.reason == concat("", ["guest request ", request, " is not in settings.guest.allowed_requests"])
	}
}

test_listed_request_allowed if {
	d := guest.decision with input as guest_input("demo", "checkpoint")
		with data.settings.guest.allowed_requests as ["checkpoint"]
	d.allow == true
	d.rule == "carrel.guest.allowed_request"
	d.reason == "guest request checkpoint is in settings.guest.allowed_requests"
}

test_requests_match_exactly if {
	every request in ["Checkpoint", "checkpoint2", "check"] {
		d := guest.decision with input as guest_input("demo", request)
			with data.settings.guest.allowed_requests as ["checkpoint"]
		d.allow == false
	}
}

test_vm_override_allows_on_one_vm if {
	overrides := {"trusted": {"guest": {"allowed_requests": ["checkpoint"]}}}
	trusted := guest.decision with input as guest_input("trusted", "checkpoint") with data.settings.vms as overrides
	trusted.allow == true
	demo := guest.decision with input as guest_input("demo", "checkpoint") with data.settings.vms as overrides
	demo.allow == false
}

test_decision_defined_for_any_input if {
	every doc in [{}, {"vm": "demo"}] {
		d := guest.decision with input as doc
		d.allow == false
		d.rule == "carrel.guest.default_deny"
	}
}
