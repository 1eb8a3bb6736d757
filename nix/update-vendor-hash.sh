#!/usr/bin/env bash
# Recompute vendorHash in nix/package.nix from go.mod and go.sum.
#
# buildGoModule's vendorHash is the NAR hash of what `go mod vendor` writes,
# so it can be computed with go and nix-hash alone, without evaluating
# nixpkgs or building anything. Run this after changing go.mod or go.sum.
#
#   nix/update-vendor-hash.sh           rewrite the hash in nix/package.nix
#   nix/update-vendor-hash.sh --check   exit 1 if it is stale (for CI)
#
# Needs: go (the version go.mod asks for), nix-hash, xxd, base64. The Go
# module cache or proxy must hold every dependency.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
pkg=$root/nix/package.nix
check=false
case "${1:-}" in
--check) check=true ;;
"") ;;
*)
	echo "usage: $0 [--check]" >&2
	exit 2
	;;
esac

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# GOFLAGS is cleared so a -mod=... in the caller's environment cannot
# change what is vendored; Nix runs the same command with its own Go.
(cd "$root" && GOFLAGS= GOTOOLCHAIN=local go mod vendor -o "$tmp/vendor")
mkdir -p "$tmp/vendor"
want="sha256-$(nix-hash --type sha256 "$tmp/vendor" | xxd -r -p | base64 -w0)"

have=$(sed -n 's/^ *vendorHash = "\(sha256-[A-Za-z0-9+\/=]*\)";.*/\1/p' "$pkg")
if [[ -z $have ]]; then
	echo "$pkg: no vendorHash = \"sha256-...\"; line found" >&2
	exit 1
fi
if [[ $have == "$want" ]]; then
	echo "vendorHash is current: $want"
	exit 0
fi
if $check; then
	echo "vendorHash in nix/package.nix is stale: it is $have, go.mod and go.sum give $want" >&2
	echo "run nix/update-vendor-hash.sh to update it" >&2
	exit 1
fi
sed -i "s|vendorHash = \"$have\";|vendorHash = \"$want\";|" "$pkg"
echo "vendorHash updated: $have -> $want"
