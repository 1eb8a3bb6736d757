#!/bin/sh
# Fetches the asciinema web player that `carrel audit report` embeds in its
# pages, from the npm registry, and checks it against what is vendored here.
# The package is asciinema-player (https://github.com/asciinema/asciinema-player),
# Apache-2.0 (LICENSE). Only its self-contained browser bundle is kept: the
# player with its terminal emulator compiled to WebAssembly inline, and its CSS.
#
# To update: change VERSION, run this script from this directory, check the
# player in a report (make a report, open it in a browser), and commit the
# files and SHA256SUMS it rewrites.
set -eu
VERSION=3.18.0
cd "$(dirname "$0")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# npm pack checks the tarball against the registry's integrity hash.
(cd "$tmp" && npm pack --silent "asciinema-player@$VERSION" >/dev/null)
tar -xzf "$tmp/asciinema-player-$VERSION.tgz" -C "$tmp"
cp "$tmp/package/dist/bundle/asciinema-player.min.js" asciinema-player.min.js
cp "$tmp/package/dist/bundle/asciinema-player.css" asciinema-player.css
cp "$tmp/package/LICENSE" LICENSE
echo "$VERSION" > VERSION
sha256sum asciinema-player.min.js asciinema-player.css LICENSE > SHA256SUMS
echo "asciinema-player $VERSION vendored"
