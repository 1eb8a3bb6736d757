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
# The agent's computer: a Debian userland on a verified, read-only root
# (erofs under dm-verity); the first build downloads its packages.
carrel image build agent
carrel image ls
carrel vm create demo --image agent --memory 1G --cpus 1
carrel vm ls
carrel exec demo -- uname -a
carrel exec demo -- sh -c 'echo "hello from $(hostname), pid 1 is $(cat /proc/1/comm)"; grep -E " / | /run/carrel/lower " /proc/mounts; df -h /workspace | tail -1'
carrel exec demo -- sh -c 'python3 --version; git --version; node --version; gcc --version | head -1'
carrel exec demo -- sh -c 'printf "#include <stdio.h>\nint main(void){puts(\"compiled in the vm\");return 0;}\n" > hello.c && gcc -o hello hello.c && ./hello'
carrel exec demo -- sh -c 'head -c 8388608 /dev/urandom > /tmp/blob && sha256sum /tmp/blob'
# What the agent changes outside /workspace is its VM's own: it survives a
# restart, and vm reset discards it.
carrel exec demo -- sh -c 'echo "installed by the agent" > ~/note && cat ~/note'
carrel vm stop demo
carrel vm start demo
carrel exec demo -- cat /home/agent/note
carrel vm reset demo
carrel exec demo -- sh -c 'cat ~/note 2>&1 || echo "gone after vm reset"'
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
