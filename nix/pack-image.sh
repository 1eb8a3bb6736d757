#!/usr/bin/env bash
# Packs a NixOS system's parts into carrel's image format, in $out: the
# build step of system.build.carrelImage (nix/modules/guest-image.nix),
# which sets the variables below. tests/nixpack_test.go runs this same
# script on the Debian builder's parts, arranged as the derivation
# arranges a NixOS system's, then checks, imports and boots the result.
#
#   out            the image directory to write
#   imageName      the image's name in carrel's store
#   kernelFile     the kernel (bzImage); kernelVersion its release
#   initrdFile     the initramfs
#   system         the verified file system: a directory (the closure laid
#                  out as nix/store/...) or an erofs image
#   verityMount    usr (a NixOS store) or root (a whole root file system)
#   kernelCmdline  init=, then the system's boot.kernelParams
#   storePaths     the closure's store paths, one per line: the package list
#   compress       optional mkfs.erofs compressor
set -euo pipefail

for v in out imageName kernelFile kernelVersion initrdFile system verityMount kernelCmdline storePaths; do
	if [ -z "${!v:-}" ]; then
		echo "pack-image.sh: \$$v is not set" >&2
		exit 2
	fi
done

args=()
if [ -d "$system" ]; then
	# Files copied from the store by the build user belong to root in the
	# guest, with one timestamp (carrel image pack's default, 0).
	args+=(--all-root)
fi
if [ -n "${compress:-}" ]; then
	args+=(--compress "$compress")
fi

carrel image pack --out "$out" --name "$imageName" \
	--kernel "$kernelFile" --kernel-version "$kernelVersion" --initrd "$initrdFile" \
	--system "$system" --mount "$verityMount" --cmdline "$kernelCmdline" \
	--closure "$storePaths" "${args[@]}"
# The same check carreld's import makes: every digest, and the verity tree
# recomputed from the file system.
carrel image check "$out"
