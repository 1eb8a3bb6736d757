{
  description = "carrel: every AI agent gets its own real computer, with hard walls and a tamper-evident record";

  # A stable NixOS release for hosts. It must carry go_1_26 at least at the
  # patch level go.mod names (buildGoModule builds with GOTOOLCHAIN=local).
  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-26.05";

  outputs =
    { self, nixpkgs }:
    let
      # carreld runs x86_64 guests under KVM or TCG; only x86_64 hosts for now.
      system = "x86_64-linux";
      pkgs = nixpkgs.legacyPackages.${system};
      # Like the Makefile's `git describe --always --dirty`.
      version = self.shortRev or self.dirtyShortRev or "dev";
      carrel = pkgs.callPackage ./nix/package.nix { inherit version; };
    in
    {
      # carreld, carrel and carrel-agent in one package (see nix/package.nix),
      # and the hardened NixOS agent image in carrel's image format
      # (nix/modules/guest.nix): `nix build .#agent-image`, then
      # `carrel image import ./result`.
      packages.${system} = {
        inherit carrel;
        default = carrel;
        agent-image = self.nixosConfigurations.agent.config.system.build.carrelImage;
      };

      overlays.default = final: _prev: {
        carrel = final.callPackage ./nix/package.nix { inherit version; };
      };

      # The NixOS host module: services.carreld (see nix/modules/carreld.nix).
      nixosModules.carreld =
        { lib, pkgs, ... }:
        {
          imports = [ ./nix/modules/carreld.nix ];
          services.carreld.package = lib.mkDefault self.packages.${pkgs.stdenv.hostPlatform.system}.carrel;
        };
      nixosModules.default = self.nixosModules.carreld;

      # The guest module (nix/modules/guest.nix): what operators compose to
      # make their own agent images.
      nixosModules.guest =
        { lib, pkgs, ... }:
        {
          imports = [ ./nix/modules/guest.nix ];
          carrel.guest.package = lib.mkDefault self.packages.${pkgs.stdenv.hostPlatform.system}.carrel;
        };

      # carrel's own agent image: the guest module with its defaults.
      nixosConfigurations.agent = nixpkgs.lib.nixosSystem {
        modules = [
          self.nixosModules.guest
          { nixpkgs.hostPlatform = system; }
        ];
      };

      checks.${system}.carrel = carrel;
    };
}
