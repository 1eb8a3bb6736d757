# carrel.guest: a NixOS system as a carrel agent computer.
#
#   nixosConfigurations.mine = nixpkgs.lib.nixosSystem {
#     system = "x86_64-linux";
#     modules = [ carrel.nixosModules.guest { carrel.guest.packages = [ ... ]; } ];
#   };
#   nix build .#nixosConfigurations.mine.config.system.build.carrelImage
#
# The system is an image-based appliance: the whole Nix store is one erofs
# file system under dm-verity (verified /usr, as systemd's usrhash= sets it
# up in the initrd), / is a tmpfs, /etc is an immutable overlay, users are
# those of the configuration alone, and there is no Nix daemon, no sshd and no network
# configuration (carrel's VMs have no NIC; egress goes through carreld's
# proxy over the agent's link). The VM's own changes live on the disks
# carreld attaches, found by their serials (guest-agent/protocol):
#
#   carrel-system, carrel-system-verity   the store and its hash tree (read-only)
#   carrel-state                          the writable layer: /var, /home, /root
#   carrel-workspace                      /workspace (carrel-agent mounts it)
#
# Every hardening setting below is a default (lib.mkDefault, or
# lib.mkOverride 900 where nixpkgs has a default of its own), so a
# configuration that imports this module changes any one of them by
# setting it;
# docs/operators.md says what each buys. nix/README.md lists every option
# used with the nixpkgs file that defines it. This machine's Nix (2.8)
# cannot evaluate nixpkgs: the module was checked against nixpkgs' module
# files, not built.
{
  config,
  lib,
  pkgs,
  modulesPath,
  ...
}:

let
  cfg = config.carrel.guest;
  inherit (lib) mkDefault mkOption types;

  agent = "${cfg.package}/libexec/carrel/carrel-agent";
  # The disks' udev names (guest-agent/protocol's serials).
  disk = serial: "/dev/disk/by-id/virtio-${serial}";
in
{
  imports = [
    "${modulesPath}/profiles/image-based-appliance.nix"
    ./guest-image.nix
  ];

  options.carrel.guest = {
    package = mkOption {
      type = types.package;
      description = ''
        The carrel package whose static `libexec/carrel/carrel-agent` runs in
        the guest. The flake's `nixosModules.guest` sets it to the flake's own.
      '';
    };

    packages = mkOption {
      type = types.listOf types.package;
      default = with pkgs; [
        bashInteractive
        coreutils
        findutils
        gnugrep
        gnused
        gawk
        gnutar
        gzip
        xz
        zstd
        unzip
        git
        curl
        wget
        cacert
        openssl
        python3
        python3Packages.pip
        nodejs
        gcc
        gnumake
        pkg-config
        jq
        ripgrep
        sqlite
        less
        file
        procps
        iproute2
        tmux
        nano
        vim
      ];
      defaultText = lib.literalMD "a coding agent's toolset, as the Debian `agent` spec's: shells, core utilities, git, curl, Python, Node.js, a C toolchain, jq, ripgrep, sqlite, tmux and editors";
      description = ''
        Packages on every command's PATH. Add to the default with
        `carrel.guest.packages = options.carrel.guest.packages.default ++ [ … ]`,
        or replace it.
      '';
    };

    user = {
      name = mkOption {
        type = types.str;
        default = "agent";
        description = "The unprivileged user that commands run as by default.";
      };
      uid = mkOption {
        type = types.int;
        default = 1000;
        description = "Its uid; the workspace template's owner (image/workspace) is 1000.";
      };
    };

    imageName = mkOption {
      type = types.strMatching "[a-z0-9][a-z0-9._-]{0,62}";
      default = "nixos-agent";
      description = "The image's name in carrel's store: `carrel vm create NAME --image <imageName>`.";
    };

    hardening.kernelParams = mkOption {
      type = types.listOf types.str;
      default = [
        "debugfs=off"
        "slab_nomerge"
        "init_on_alloc=1"
        "init_on_free=1"
        "page_alloc.shuffle=1"
        "randomize_kstack_offset=on"
        "vsyscall=none"
      ];
      description = ''
        Kernel hardening parameters (docs/operators.md says what each buys).
        Set the option to change them; the module's other parameters
        (console, panic) stay.
      '';
    };

    compression = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "lz4hc";
      description = ''
        mkfs.erofs compressor for the store image. None by default: an
        uncompressed store reads fastest; `lz4hc` roughly halves its size.
      '';
    };
  };

  config = {
    system.image.id = mkDefault cfg.imageName;
    system.image.version = mkDefault config.system.nixos.release;
    system.stateVersion = mkDefault config.system.nixos.release;
    networking.hostName = mkDefault "carrel";

    # --- Boot: the kernel and initrd are booted directly by QEMU. ---
    boot.loader.grub.enable = false;
    boot.initrd.systemd.enable = true;
    # systemd-veritysetup in the initrd: usrhash= on the command line (the
    # image's, from carrel image pack) gives /dev/mapper/usr, mounted on /usr.
    boot.initrd.systemd.dmVerity.enable = true;
    boot.initrd.supportedFilesystems = [
      "erofs"
      "ext4"
    ];
    boot.initrd.availableKernelModules = [
      "virtio_pci"
      "virtio_mmio"
      "virtio_blk"
    ];
    # Loaded at boot, before module loading is locked: the agent's two
    # transports, ext4 for the workspace disk it mounts itself, and
    # overlay for the containers agents run. Add what else your agents
    # need (veth, bridge, nf_tables), or unlock modules.
    boot.kernelModules = [
      "vmw_vsock_virtio_transport"
      "virtio_console"
      "ext4"
      "overlay"
    ];
    boot.kernelParams = [
      "console=ttyS0"
      "panic=-1"
      # A failed initrd panics (and QEMU exits) instead of waiting in
      # emergency mode until carreld's boot timeout.
      "boot.panic_on_fail"
    ]
    ++ cfg.hardening.kernelParams;

    # --- File systems. ---
    fileSystems."/" = {
      fsType = "tmpfs";
      options = [
        "mode=0755"
        "nodev"
      ];
    };
    # The store is the verified erofs's nix/store (image/pack lays the
    # closure out so), mounted read-only on /usr by the initrd.
    fileSystems."/nix/store" = {
      device = "/usr/nix/store";
      fsType = "none";
      options = [ "bind" ];
    };
    # No /usr/bin/env: /usr is the read-only store image.
    system.activationScripts.usrbinenv = lib.mkForce "";

    # The writable layer: carrel.state=disk puts the state disk's ext4 on
    # /var (grown to the disk), with /home and /root bound from it;
    # carrel.state=memory leaves them on the tmpfs root. carrel-agent does
    # it, as it does as the initramfs's PID 1 in carrel's Debian images.
    boot.initrd.systemd.storePaths = [ agent ];
    boot.initrd.systemd.services.carrel-state = {
      description = "carrel: the VM's writable layer";
      after = [ "sysroot.mount" ];
      requires = [ "sysroot.mount" ];
      before = [ "initrd-fs.target" ];
      requiredBy = [ "initrd-fs.target" ];
      unitConfig.DefaultDependencies = false;
      serviceConfig = {
        Type = "oneshot";
        RemainAfterExit = true;
        ExecStart = "${agent} --mount-state /sysroot";
        # The reason a boot fails reaches the console, which carreld
        # quotes in the error of the failed vm create.
        StandardOutput = "journal+console";
        StandardError = "journal+console";
      };
    };

    # --- Immutable /etc; users are the configuration's alone. ---
    system.etc.overlay.enable = true;
    system.etc.overlay.mutable = false;
    # Userborn, not systemd-sysusers, which makes no normal users; with an
    # immutable /etc it keeps the password files in /var/lib/nixos.
    services.userborn.enable = true;
    users.mutableUsers = false; # also set by image-based-appliance.nix
    # Nobody logs in: root's password is locked and the VM has no sshd;
    # carrel-agent is the only way in.
    users.allowNoPasswordLogin = true;
    users.users.${cfg.user.name} = {
      isNormalUser = true;
      inherit (cfg.user) uid;
      home = "/home/${cfg.user.name}";
      shell = pkgs.bashInteractive;
    };
    users.users.root.hashedPassword = "!";

    # --- No Nix, no sshd, no network. ---
    nix.enable = false; # also set by image-based-appliance.nix
    services.openssh.enable = false;
    networking.useDHCP = false;
    networking.useNetworkd = false;
    networking.firewall.enable = false; # no NIC; nothing to filter
    documentation.enable = false;

    # --- The agent. ---
    environment.systemPackages = cfg.packages;
    # carrel-agent reads the image's environment for every command here.
    environment.etc."environment".text = ''
      PATH=/home/${cfg.user.name}/.local/bin:/run/wrappers/bin:/run/current-system/sw/bin
      NPM_CONFIG_PREFIX=/home/${cfg.user.name}/.local
      SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
      LANG=C.UTF-8
    '';
    systemd.services.carrel-agent = {
      description = "carrel guest agent: serves the host over vsock or virtio-serial";
      documentation = [ "https://github.com/carrel-os/carrel" ];
      wantedBy = [ "multi-user.target" ];
      after = [ "local-fs.target" ];
      serviceConfig = {
        ExecStart = "${agent} --system";
        Restart = "always";
        RestartSec = 1;
        # Each command gets a cgroup of its own below the service's.
        Delegate = true;
        # The agent ends its commands; systemd gives the rest a grace period.
        KillMode = "mixed";
      };
    };
    # Started as soon as either transport exists, not only at
    # multi-user.target.
    services.udev.extraRules = ''
      KERNEL=="vsock", TAG+="systemd", ENV{SYSTEMD_WANTS}+="carrel-agent.service"
      SUBSYSTEM=="virtio-ports", ATTR{name}=="org.carrel.agent.0", TAG+="systemd", ENV{SYSTEMD_WANTS}+="carrel-agent.service"
    '';

    # --- Hardening (the removed profiles/hardened.nix as a checklist;
    # its module blacklist is left out: it blocks erofs). ---
    security.lockKernelModules = mkDefault true;
    security.protectKernelImage = mkDefault true;
    security.forcePageTableIsolation = mkDefault true;
    security.sudo.enable = mkDefault false;
    boot.kernel.sysctl =
      let
        # Above nixpkgs' own defaults (mkDefault) for some of these keys,
        # below a configuration's plain setting.
        harden = lib.mkOverride 900;
      in
      {
        "kernel.kptr_restrict" = harden 2;
        "kernel.dmesg_restrict" = harden 1;
        "kernel.yama.ptrace_scope" = harden 1;
        "kernel.unprivileged_bpf_disabled" = harden 1;
        "net.core.bpf_jit_harden" = harden 2;
        "kernel.ftrace_enabled" = harden false;
        "kernel.perf_event_paranoid" = harden 3;
        "kernel.sysrq" = harden 0;
        "fs.protected_fifos" = harden 2;
        "fs.protected_regular" = harden 2;
        "fs.suid_dumpable" = harden 0;
      };
  };
}
