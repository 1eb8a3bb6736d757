# system.build.carrelImage: a carrel.guest system (guest.nix) as a
# directory in carrel's image format (docs/image-format.md), ready for
# `carrel image import`. The flake's packages.x86_64-linux.agent-image is
# this attribute of nixosConfigurations.agent.
#
# The derivation lays the system's closure out as the verified /usr holds
# it (nix/store/<path>) and runs nix/pack-image.sh, which runs
# `carrel image pack`: carrel's own Go code makes the erofs, its dm-verity
# tree, the workspace template and the manifest. tests/nixpack_test.go runs
# the same script on the Debian builder's parts and boots the result.
{
  config,
  lib,
  pkgs,
  ...
}:

let
  cfg = config.carrel.guest;
  toplevel = config.system.build.toplevel;
  kernel = config.boot.kernelPackages.kernel;
  closure = pkgs.closureInfo { rootPaths = [ toplevel ]; };
in
{
  system.build.carrelImage =
    pkgs.runCommand "carrel-image-${cfg.imageName}-${config.system.image.version}"
      {
        nativeBuildInputs = [
          cfg.package # carrel image pack
          pkgs.erofs-utils # mkfs.erofs, which carrel image pack runs
          pkgs.e2fsprogs # mkfs.ext4, for the workspace template
        ];
        # The image holds its store paths' bytes, not references to them:
        # it must not keep the closure alive beside itself.
        __structuredAttrs = true;
        unsafeDiscardReferences.out = true;

        imageName = cfg.imageName;
        kernelFile = "${kernel}/${config.system.boot.loader.kernelFile}";
        kernelVersion = kernel.modDirVersion;
        initrdFile = "${config.system.build.initialRamdisk}/${config.system.boot.loader.initrdFile}";
        # What the verity-store appliance's UKI carries, less usrhash=,
        # which carrel image pack adds from the tree it computes.
        kernelCmdline = "init=${toplevel}/init ${toString config.boot.kernelParams}";
        storePaths = "${closure}/store-paths";
        compress = lib.optionalString (cfg.compression != null) cfg.compression;
      }
      ''
        mkdir -p usr/nix/store
        xargs -a "$storePaths" cp -a --target-directory=usr/nix/store
        export out imageName kernelFile kernelVersion initrdFile kernelCmdline storePaths compress
        export system=$PWD/usr verityMount=usr
        bash ${../pack-image.sh}
      '';
}
