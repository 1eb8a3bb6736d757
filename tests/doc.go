// Package tests holds carrel's end-to-end tests: a real carreld, the real
// carrel CLI and real VMs under QEMU (TCG on machines without usable KVM).
//
// They need qemu-system-x86_64 and apt access for the dev image (make deps).
// Without QEMU they skip, unless CARREL_REQUIRE_VM=1 (set by make test) makes
// that a failure. The harness they share is in tests/harness; benchmarks
// are in tests/bench (make bench).
package tests
