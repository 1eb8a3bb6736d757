#!/usr/bin/env bash
# Proves that the control plane `make fleet-tools` built works: etcd,
# kube-apiserver (TLS, tokens, RBAC), kube-scheduler, kube-controller-manager
# and kwok, all on 127.0.0.1. A Node that kwok keeps Ready is created and
# read back; the controller manager lifts its not-ready taint and makes the
# default ServiceAccount; the scheduler binds a pod to it; kwok runs the pod.
# Then each process gets SIGTERM and must be gone within 20 s. etcd shuts
# down and re-raises the signal, and kube-controller-manager handles SIGTERM
# only with an alpha feature gate, so both end with status 143.
#
#   smoke.sh BIN_DIR   (the bin directory build-tools.sh prints)
#   KEEP=1 keeps the work directory (logs, certificates, etcd data).
set -euo pipefail

[[ $# -eq 1 ]] || { echo "usage: $0 BIN_DIR" >&2; exit 2; }
bin=$(cd "$1" && pwd)
stages=$bin/../stages
for t in curl jq openssl ss; do
	command -v $t >/dev/null || { echo "smoke: $t is missing (apt-get install curl jq openssl iproute2)" >&2; exit 1; }
done

start=$SECONDS
dir=$(mktemp -d /tmp/carrel-fleet-smoke.XXXXXX)
names=() pids=()
log() { echo "smoke: [$((SECONDS - start)) s] $*"; }

stop_all() {
	local rc=$? i pid name code failed=0
	for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
		pid=${pids[i]} name=${names[i]}
		kill -TERM "$pid" 2>/dev/null || true
		for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
		if kill -0 "$pid" 2>/dev/null; then
			kill -KILL "$pid"
			echo "smoke: $name did not exit within 20 s of SIGTERM" >&2
			failed=1
		fi
		code=0
		wait "$pid" 2>/dev/null || code=$?
		log "$name stopped (exit status $code)"
	done
	if [[ $rc -ne 0 ]]; then
		for name in "${names[@]}"; do
			echo "--- last lines of $name.log"
			tail -n 20 "$dir/$name.log"
		done
	fi
	if [[ -n ${KEEP-} ]]; then echo "smoke: kept $dir"; else rm -rf "$dir"; fi
	if [[ $rc -eq 0 && $failed -ne 0 ]]; then rc=1; fi
	if [[ $rc -eq 0 ]]; then log "ok"; else echo "smoke: FAILED" >&2; fi
	exit "$rc"
}
trap stop_all EXIT

# Free loopback ports, picked at random and checked against ss.
taken=" "
pick_port() {
	local p
	while :; do
		p=$((20000 + RANDOM % 30000))
		[[ $taken == *" $p "* ]] && continue
		[[ -z $(ss -Htan "sport = :$p") ]] || continue
		taken+="$p "
		printf -v "$1" %s "$p"
		return
	done
}
pick_port etcd_port
pick_port etcd_peer_port
pick_port api_port
pick_port sched_port
pick_port kcm_port

run() { # name binary args...
	local name=$1
	shift
	"$@" >"$dir/$name.log" 2>&1 &
	names+=("$name") pids+=($!)
	log "$name started (pid $!)"
}

# wait_for WHAT SECONDS COMMAND...: poll until COMMAND succeeds, failing
# early if a started process has died.
wait_for() {
	local what=$1 limit=$2 i deadline=$((SECONDS + $2))
	shift 2
	until "$@" >/dev/null 2>&1; do
		for i in "${!pids[@]}"; do
			kill -0 "${pids[i]}" 2>/dev/null || { echo "smoke: ${names[i]} exited while waiting for $what" >&2; return 1; }
		done
		((SECONDS < deadline)) || { echo "smoke: no $what after $limit s" >&2; return 1; }
		sleep 0.5
	done
	log "$what"
}

# A CA, one serving certificate for every component (127.0.0.1 and
# localhost), the service-account signing key and one token per client.
cd "$dir"
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 1 -subj /CN=carrel-fleet-smoke-ca 2>/dev/null
openssl req -newkey rsa:2048 -nodes -keyout serving.key -out serving.csr -subj /CN=127.0.0.1 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' >serving.ext
openssl x509 -req -in serving.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 -extfile serving.ext -out serving.crt 2>/dev/null
openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out sa.key 2>/dev/null
openssl pkey -in sa.key -pubout -out sa.pub
admin_token=$(openssl rand -hex 16)
{
	echo "$admin_token,carrel-smoke-admin,uid-admin,system:masters"
	echo "$(openssl rand -hex 16),system:kube-scheduler,uid-scheduler"
	echo "$(openssl rand -hex 16),system:kube-controller-manager,uid-kcm"
	echo "$(openssl rand -hex 16),carrel-smoke-kwok,uid-kwok,system:masters"
} >tokens.csv
kubeconfig() { # file user
	local token
	token=$(grep ",$2," tokens.csv | cut -d, -f1)
	cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: smoke
  cluster: {server: "https://127.0.0.1:$api_port", certificate-authority: "$dir/ca.crt"}
users:
- name: "$2"
  user: {token: "$token"}
contexts:
- name: smoke
  context: {cluster: smoke, user: "$2"}
current-context: smoke
EOF
}
kubeconfig scheduler.kubeconfig system:kube-scheduler
kubeconfig kcm.kubeconfig system:kube-controller-manager
kubeconfig kwok.kubeconfig carrel-smoke-kwok
serving=(--tls-cert-file="$dir/serving.crt" --tls-private-key-file="$dir/serving.key")

run etcd "$bin/etcd" --name smoke --data-dir "$dir/etcd" \
	--listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
	--listen-peer-urls "http://127.0.0.1:$etcd_peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer_port" \
	--initial-cluster "smoke=http://127.0.0.1:$etcd_peer_port"
wait_for "etcd healthy" 30 sh -c "curl -sf http://127.0.0.1:$etcd_port/health | jq -e '.health == \"true\"'"

# The endpoint reconciler refuses a loopback advertise address ("may not be
# in the loopback range"); nothing here needs the kubernetes Service's
# endpoints.
run kube-apiserver "$bin/kube-apiserver" --etcd-servers "http://127.0.0.1:$etcd_port" \
	--bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$api_port" "${serving[@]}" \
	--client-ca-file "$dir/ca.crt" --token-auth-file "$dir/tokens.csv" --authorization-mode RBAC \
	--service-account-issuer https://kubernetes.default.svc --service-account-key-file "$dir/sa.pub" \
	--service-account-signing-key-file "$dir/sa.key" --service-cluster-ip-range 10.96.0.0/16 \
	--endpoint-reconciler-type none
api() { # method path [body]: the API as the admin
	local body=()
	[[ $# -lt 3 ]] || body=(--data "$3")
	curl -sS --fail-with-body --cacert "$dir/ca.crt" -H "Authorization: Bearer $admin_token" \
		-H 'Content-Type: application/json' -X "$1" "https://127.0.0.1:$api_port$2" "${body[@]}"
}
wait_for "kube-apiserver /readyz ok" 90 sh -c "curl -sf --cacert '$dir/ca.crt' -H 'Authorization: Bearer $admin_token' https://127.0.0.1:$api_port/readyz | grep -qx ok"

run kube-scheduler "$bin/kube-scheduler" --kubeconfig "$dir/scheduler.kubeconfig" \
	--authentication-kubeconfig "$dir/scheduler.kubeconfig" --authorization-kubeconfig "$dir/scheduler.kubeconfig" \
	--bind-address 127.0.0.1 --secure-port "$sched_port" "${serving[@]}"
run kube-controller-manager "$bin/kube-controller-manager" --kubeconfig "$dir/kcm.kubeconfig" \
	--authentication-kubeconfig "$dir/kcm.kubeconfig" --authorization-kubeconfig "$dir/kcm.kubeconfig" \
	--bind-address 127.0.0.1 --secure-port "$kcm_port" "${serving[@]}" \
	--use-service-account-credentials --service-account-private-key-file "$dir/sa.key" --root-ca-file "$dir/ca.crt" \
	--cluster-signing-cert-file "$dir/ca.crt" --cluster-signing-key-file "$dir/ca.key"
run kwok "$bin/kwok" --kubeconfig "$dir/kwok.kubeconfig" \
	--config "$(ls "$stages"/*.yaml | paste -sd, -)" --manage-nodes-with-annotation-selector kwok.x-k8s.io/node=fake \
	--node-ip 127.0.0.1 --node-lease-duration-seconds 40
healthz() { curl -sf --cacert "$dir/ca.crt" "https://127.0.0.1:$1/healthz" | grep -qx ok; }
wait_for "kube-scheduler /healthz ok" 60 healthz "$sched_port"
wait_for "kube-controller-manager /healthz ok" 60 healthz "$kcm_port"

node=carrel-smoke-0
api POST /api/v1/nodes "$(jq -nc --arg n $node '{apiVersion: "v1", kind: "Node",
	metadata: {name: $n, labels: {"carrel.dev/smoke": "true"}, annotations: {"kwok.x-k8s.io/node": "fake"}}}')" >created.json
api GET /api/v1/nodes/$node >read.json
jq -e --arg n $node --slurpfile c created.json \
	'.metadata.name == $n and .metadata.uid == $c[0].metadata.uid and .metadata.labels["carrel.dev/smoke"] == "true"' read.json >/dev/null
log "node $node created and read back (uid $(jq -r .metadata.uid read.json), taints $(jq -c '[.spec.taints[]?.key]' read.json))"

node_ready() { api GET /api/v1/nodes/$node | jq -e '.status.conditions[] | select(.type == "Ready") | .status == "True"'; }
wait_for "node Ready (kwok)" 60 node_ready
untainted() { api GET /api/v1/nodes/$node | jq -e '[.spec.taints[]? | select(.key == "node.kubernetes.io/not-ready")] | length == 0'; }
wait_for "not-ready taint lifted (kube-controller-manager)" 90 untainted
wait_for "default ServiceAccount made (kube-controller-manager)" 60 api GET /api/v1/namespaces/default/serviceaccounts/default

api POST /api/v1/namespaces/default/pods '{"apiVersion":"v1","kind":"Pod","metadata":{"name":"smoke"},
	"spec":{"containers":[{"name":"c","image":"none"}]}}' >/dev/null
bound() { api GET /api/v1/namespaces/default/pods/smoke | jq -e --arg n $node '.spec.nodeName == $n'; }
wait_for "pod bound to $node (kube-scheduler)" 60 bound
running() { api GET /api/v1/namespaces/default/pods/smoke | jq -e '.status.phase == "Running"'; }
wait_for "pod Running (kwok)" 60 running
