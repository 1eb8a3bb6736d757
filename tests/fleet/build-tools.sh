#!/usr/bin/env bash
# Builds the fleet tests' control plane from the Go module proxy: etcd,
# kube-apiserver, kube-scheduler, kube-controller-manager and kwok, at the
# versions tests/fleet/tools pins, into DIR/<key>/bin, with kwok's stage
# configs in DIR/<key>/stages. The key hashes this script, the tools
# modules and the Go version, so a bump rebuilds and an unchanged tree
# reuses what an earlier run built (the first build takes many minutes).
#
#   build-tools.sh DIR            build if missing; print the bin directory
#   build-tools.sh --bin-dir DIR  print DIR/<key>/bin, build nothing
set -euo pipefail

print_only=
if [[ ${1-} == --bin-dir ]]; then print_only=1; shift; fi
[[ $# -eq 1 ]] || { echo "usage: $0 [--bin-dir] DIR" >&2; exit 2; }
root=$1
GO=${GO:-go}
here=$(cd "$(dirname "$0")" && pwd)
tools=$here/tools

key=$(
	cd "$here"
	{ "$GO" version; sha256sum build-tools.sh; find tools -type f | LC_ALL=C sort | xargs sha256sum; } | sha256sum | cut -c1-16
)
dest=$root/$key
if [[ -n $print_only ]]; then echo "$dest/bin"; exit 0; fi

binaries=(etcd kube-apiserver kube-scheduler kube-controller-manager kwok)
complete() { for b in "${binaries[@]}"; do [[ -x $dest/bin/$b ]] || return 1; done; }
if complete; then
	echo "fleet-tools: built in $dest/bin"
	exit 0
fi

mkdir -p "$root"
tmp=$(mktemp -d "$dest.new.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/bin" "$tmp/stages"

# As upstream builds them: static, paths trimmed, symbols stripped.
# Kubernetes adds its build tags and stamps its version (hack/lib/golang.sh,
# hack/lib/version.sh); etcd's and kwok's versions are constants in source.
export CGO_ENABLED=0
build() { # name module-dir package [go build flags...]
	local name=$1 dir=$2 pkg=$3 start=$SECONDS
	shift 3
	echo "fleet-tools: building $name ($pkg)"
	(cd "$dir" && "$GO" build -trimpath -o "$tmp/bin/$name" "$@" "$pkg")
	echo "fleet-tools: $name built in $((SECONDS - start)) s, $(($(stat -c %s "$tmp/bin/$name") / 1048576)) MiB"
}

build etcd "$tools/etcd" go.etcd.io/etcd/server/v3 -ldflags '-s -w'

kube=$(cd "$tools" && "$GO" list -m -f '{{.Version}} {{.Time.UTC.Format "2006-01-02T15:04:05Z"}}' k8s.io/kubernetes)
kube_version=${kube% *} kube_date=${kube#* }
IFS=. read -r major minor _ <<<"${kube_version#v}"
kube_ldflags="-s -w"
for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
	kube_ldflags+=" -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
	kube_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$kube_date"
done
for cmd in kube-apiserver kube-scheduler kube-controller-manager; do
	build "$cmd" "$tools" "k8s.io/kubernetes/cmd/$cmd" -tags selinux,notest,grpcnotrace -ldflags "$kube_ldflags"
done

build kwok "$tools/kwok" sigs.k8s.io/kwok/cmd/kwok -ldflags '-s -w'
# kwok acts only through Stage objects; these are the ones kwokctl uses by
# default: nodes become Ready and renew their Leases, pods become Ready.
kwok_src=$(cd "$tools/kwok" && "$GO" list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
for f in node/fast/node-initialize node/heartbeat-with-lease/node-heartbeat-with-lease \
	pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete; do
	cp "$kwok_src/kustomize/stage/$f.yaml" "$tmp/stages/"
done
chmod -R u+w "$tmp/stages"

# Another run may have finished the same key meanwhile: keep the first.
chmod 755 "$tmp"
if [[ -e $dest ]] && ! complete; then rm -rf "$dest"; fi
if mv -T "$tmp" "$dest" 2>/dev/null || complete; then
	echo "fleet-tools: built in $dest/bin"
else
	echo "fleet-tools: could not move $tmp to $dest" >&2
	exit 1
fi
