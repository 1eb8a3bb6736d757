# carreld (host supervisor), carrel (CLI), carrel-agent (static guest
# agent), carrel-node (carreld's fleet node helper) and carrel-controller,
# built from this checkout. Layout of the output:
#   bin/carreld, bin/carrel, bin/carrel-controller
#   libexec/carrel/carrel-agent     the guest binary; not a host command
#   libexec/carrel/carrel-node      started by carreld --kubeconfig
#   lib/systemd/system/carreld.{service,socket}
#   lib/sysusers.d/carrel.conf      the "carrel" group for the API socket
{
  lib,
  # go.mod sets `go 1.26.x` and buildGoModule builds with GOTOOLCHAIN=local,
  # so this nixpkgs' go_1_26 must be at least the patch release go.mod names.
  buildGo126Module,
  version ? "dev",
}:

buildGo126Module (finalAttrs: {
  pname = "carrel";
  inherit version;

  # The whole checkout except the Nix files (and local build litter when
  # used outside a flake), so editing Nix code does not rebuild the Go code.
  src = lib.fileset.toSource {
    root = ../.;
    fileset = lib.fileset.difference ../. (
      lib.fileset.unions [
        ./.
        ../flake.nix
        (lib.fileset.maybeMissing ../flake.lock)
        (lib.fileset.maybeMissing ../out)
        (lib.fileset.maybeMissing ../.cache)
        (lib.fileset.maybeMissing ../.bin)
        (lib.fileset.maybeMissing ../result)
      ]
    );
  };

  # The NAR hash of `go mod vendor`'s output: buildGoModule fetches the Go
  # dependencies in a fixed-output derivation, and this pins its result. It
  # changes whenever go.mod or go.sum does. To update it, run
  #   nix/update-vendor-hash.sh
  # which recomputes it with go and nix-hash alone (no nixpkgs evaluation,
  # no network beyond the Go module proxy), or build once with
  # `nix build .#carrel`: a stale hash fails with
  # "hash mismatch in fixed-output derivation ... got: sha256-...", and the
  # "got" value is the one to put here. `nix/update-vendor-hash.sh --check`
  # fails when it is stale (for CI).
  vendorHash = "sha256-W6nblEPL4de3cVbbnJ9begfmVqK24XpRFky+ejo9uLw=";

  subPackages = [
    "cmd/carreld"
    "cmd/carrel"
    "cmd/carrel-policy" # the policy engine carrel runs for policy test/check/eval
    "cmd/carrel-agent"
    "cmd/carrel-node" # carreld's Kubernetes node helper (carreld --kubeconfig)
    "cmd/carrel-controller" # the fleet's controller, for clusters that run it from Nix
  ];

  # Pure Go throughout; carrel-agent must be one static binary because it
  # runs as /init in the guest.
  env.CGO_ENABLED = 0;

  ldflags = [
    "-s"
    "-w"
    "-X github.com/carrel-os/carrel/supervisor/daemon.Version=${finalAttrs.version}"
    "-X github.com/carrel-os/carrel/guest-agent/server.Version=${finalAttrs.version}"
    "-X main.version=${finalAttrs.version}"
  ];

  postInstall = ''
    # carreld looks for the agent beside itself, then in
    # /usr/libexec/carrel; from the store it is passed with --agent.
    mkdir -p $out/libexec/carrel
    mv $out/bin/carrel-agent $out/libexec/carrel/carrel-agent
    # carreld starts carrel-node itself, from beside it or with
    # --fleet-helper; it is no command of its own.
    mv $out/bin/carrel-node $out/libexec/carrel/carrel-node

    # The unit files, for systemd hosts that are not NixOS (NixOS gets its
    # units from nix/modules/carreld.nix). They point into this store path.
    install -Dm644 -t $out/lib/systemd/system \
      supervisor/systemd/units/carreld.service \
      supervisor/systemd/units/carreld.socket
    substituteInPlace $out/lib/systemd/system/carreld.service \
      --replace-fail "ExecStart=/usr/bin/carreld " \
                     "ExecStart=$out/bin/carreld --agent $out/libexec/carrel/carrel-agent "
    install -Dm644 supervisor/systemd/units/carrel-sysusers.conf \
      $out/lib/sysusers.d/carrel.conf
  '';

  meta = {
    description = "Gives every AI agent its own VM on your hardware, with hard walls and a tamper-evident audit log";
    homepage = "https://github.com/carrel-os/carrel";
    mainProgram = "carrel";
    platforms = [ "x86_64-linux" ];
  };
})
