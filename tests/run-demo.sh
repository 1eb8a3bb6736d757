#!/usr/bin/env bash
# `make run`: start a throwaway carreld, build the dev image, boot a VM, run
# a short session in it, and tear everything down again.
set -euo pipefail
BIN=${BIN:?set BIN to the directory with carreld, carrel and carrel-agent}
CACHE=${CACHE:-/var/cache/carrel}
work=$(mktemp -d /tmp/carrel-run.XXXXXX)
export CARREL_SOCKET=$work/carrel.sock
carrel() { echo "+ carrel $*" >&2; "$BIN/carrel" "$@"; }

"$BIN/carreld" --state-dir "$work/state" --socket "$CARREL_SOCKET" --cache-dir "$CACHE" \
	--agent "$BIN/carrel-agent" 2>"$work/carreld.log" &
carreld_pid=$!
cleanup() {
	"$BIN/carrel" vm rm --force demo >/dev/null 2>&1 || true
	kill "$carreld_pid" 2>/dev/null && wait "$carreld_pid" 2>/dev/null || true
	echo "carreld log: $work/carreld.log" >&2
}
trap cleanup EXIT

for _ in $(seq 300); do "$BIN/carrel" info >/dev/null 2>&1 && break; sleep 0.1; done
carrel info
carrel image build --dev
carrel image ls
carrel vm create demo --image dev --memory 512M --cpus 1
carrel vm ls
carrel exec demo -- uname -a
carrel exec demo -- sh -c 'echo "hello from $(hostname), pid 1 is $(cat /proc/1/comm)"; df -h /workspace | tail -1'
carrel exec demo -- sh -c 'head -c 8388608 /dev/urandom > /tmp/blob && sha256sum /tmp/blob'
set +e
carrel exec demo -- sh -c 'echo "to stderr" >&2; exit 3'
echo "exit code: $?"
carrel cp demo:/etc/shadow -    # denied by the default policy, naming the rule
set -e
carrel policy decisions --vm demo --limit 5
audit=$work/state/audit
key=$("$BIN/carrel" audit key --dir "$audit")
session=$("$BIN/carrel" vm ls -o json | sed -n 's/.*"session": *"\(ses_[0-9a-f]*\)".*/\1/p' | head -1)
carrel vm stop demo
carrel vm ls
carrel vm rm demo
# Review, offline, as a compliance reviewer would: carreld stops first, and
# signs a last checkpoint.
kill "$carreld_pid" && wait "$carreld_pid" || true
carrel audit show "$session" --dir "$audit" --kind 'vm.lifecycle,action.intent,exec.exit,file.op'
carrel audit replay "$session" --dir "$audit" --speed 20
carrel audit export "$session" --dir "$audit" --key "$key" -o "$work/evidence.tar"
carrel audit report "$session" --dir "$audit" -o "$work/report.html"
carrel audit verify --bundle "$work/evidence.tar" --key "$key"
carrel audit verify --dir "$audit" --key "$key"
echo "evidence bundle: $work/evidence.tar; report: $work/report.html" >&2
