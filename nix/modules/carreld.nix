# services.carreld: the carrel host supervisor on a NixOS host.
#
#   imports = [ carrel.nixosModules.carreld ];
#   services.carreld.enable = true;
#   users.users.alice.extraGroups = [ "carrel" ];   # may use the API socket
#
# The unit mirrors supervisor/systemd/units/carreld.service (the unit file
# for other distributions); keep the two in step. It is tighter in two
# places, because the development image builder (apt-get) cannot run on
# NixOS: no capabilities at all, and no AF_INET/AF_INET6/AF_NETLINK.
{
  config,
  lib,
  pkgs,
  utils,
  ...
}:

let
  cfg = config.services.carreld;
  inherit (lib)
    mkEnableOption
    mkIf
    mkOption
    mkPackageOption
    types
    ;

  defaultSocket = "/run/carrel/carrel.sock";
  # StateDirectory= manages directories below /var/lib only; any other
  # stateDir is created by tmpfiles and made writable explicitly.
  stateUnderVarLib = lib.hasPrefix "/var/lib/" cfg.stateDir;
  useLibvirt = cfg.driver == "libvirt";
in
{
  options.services.carreld = {
    enable = mkEnableOption "carreld, the carrel host supervisor, which runs one hardened QEMU VM per AI agent";

    # The flake's nixosModules.carreld sets this to the flake's own package.
    package = mkPackageOption pkgs "carrel" { };

    # qemu_kvm is QEMU for the host's architecture only. It still has TCG,
    # which carreld uses where KVM is not usable.
    qemuPackage = mkPackageOption pkgs "qemu_kvm" { };

    stateDir = mkOption {
      type = types.strMatching "/.+";
      default = "/var/lib/carrel";
      description = ''
        Directory for images, VM records and per-VM sockets (carreld's
        `--state-dir`). Only root can read it.
      '';
    };

    socket = mkOption {
      type = types.strMatching "/.+";
      default = defaultSocket;
      description = ''
        Path of the API socket. systemd listens on it (carreld.socket) and
        hands it to carreld; members of the `carrel` group may connect.
        When it is not the default, `CARREL_SOCKET` is set system-wide so
        the `carrel` CLI finds it.
      '';
    };

    driver = mkOption {
      type = types.enum [
        "qemu"
        "libvirt"
      ];
      default = "qemu";
      description = ''
        How carreld runs new VMs (carreld's `--driver`): `qemu` starts QEMU
        itself; `libvirt` runs them as libvirt domains through libvirtd,
        which is then enabled (`virtualisation.libvirtd.enable`) and
        started before carreld. Existing VMs keep the driver they were
        created with.
      '';
    };

    libvirtURI = mkOption {
      type = types.str;
      default = "qemu:///system";
      description = "libvirt connection of the libvirt driver (carreld's `--libvirt-uri`).";
    };

    images = mkOption {
      type = types.listOf types.path;
      default = [ ];
      example = lib.literalExpression "[ carrel.packages.x86_64-linux.agent-image ]";
      description = ''
        Image directories in carrel's format (such as the flake's
        `agent-image`) that carreld imports when it starts (carreld's
        `--import-image`), each tagged with its name. carreld checks each in
        full, as `carrel image import` does; an image already stored is left
        as it is, so a restart costs a read of each manifest. An image that
        fails to import is logged and left out, and the others still serve.
      '';
    };

    e2bListen = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "127.0.0.1:3000";
      description = ''
        TCP address to serve the e2b API on (carreld's `--e2b-listen`): the
        control plane and envd, for unmodified e2b SDKs, authenticated by
        API keys (`carrel key create`). Plain HTTP: keep it on loopback, or
        put TLS in front of it. Off when null.
      '';
    };

    fleet = {
      kubeconfig = mkOption {
        type = types.nullOr types.str;
        default = null;
        example = "/etc/carrel/kubeconfig";
        description = ''
          Join a Kubernetes fleet (carreld's `--kubeconfig`): a kubeconfig
          file with this host's Node identity (user `system:node:NAME` in
          groups `system:nodes` and `carrel:nodes`). carreld then registers
          the Node, renews its Lease, publishes its GPUs and boots the
          AgentVM runs placed on it. A path outside the store, since it holds
          a credential. Off when null.
        '';
      };
      nodeName = mkOption {
        type = types.nullOr types.str;
        default = null;
        description = "The fleet Node's name (default `carrel-HOSTNAME`).";
      };
      fenceAfter = mkOption {
        type = types.str;
        default = "30s";
        description = ''
          Stop this host's fleet VMs, and refuse their calls, once the Node's
          Lease has gone unrenewed this long. Keep it well under
          carrel-controller's `--node-loss-timeout` (60s).
        '';
      };
    };

    extraArgs = mkOption {
      type = types.listOf types.str;
      default = [ ];
      example = [
        "--log-level"
        "debug"
        "--machine"
        "q35"
      ];
      description = "Extra command-line arguments for carreld.";
    };
  };

  config = mkIf cfg.enable {
    # /dev/vhost-vsock, the preferred link to each guest's agent. Where the
    # kernel lacks it carreld falls back to virtio-serial.
    boot.kernelModules = [ "vhost_vsock" ];

    # Members may use the API socket (mode 0660, group carrel).
    users.groups.carrel = { };

    # The libvirt driver needs libvirtd (and its virtlogd).
    virtualisation.libvirtd.enable = mkIf useLibvirt true;

    environment.systemPackages = [ cfg.package ];
    environment.variables = mkIf (cfg.socket != defaultSocket) { CARREL_SOCKET = cfg.socket; };

    systemd.tmpfiles.rules = lib.optional (!stateUnderVarLib) "d ${cfg.stateDir} 0700 root root - -";

    # systemd holds the socket, so clients queue while carreld restarts.
    systemd.sockets.carreld = {
      description = "carrel host supervisor API socket";
      wantedBy = [ "sockets.target" ];
      listenStreams = [ cfg.socket ];
      socketConfig = {
        SocketUser = "root";
        SocketGroup = "carrel";
        SocketMode = "0660";
        DirectoryMode = "0755";
        Accept = false;
      };
    };

    systemd.services.carreld = {
      description = "carrel host supervisor (one hardened VM per AI agent)";
      documentation = [ "https://github.com/carrel-os/carrel" ];
      wantedBy = [ "multi-user.target" ];
      requires = [ "carreld.socket" ];
      # With the libvirt driver carreld checks that libvirtd answers before
      # it serves.
      wants = lib.optional useLibvirt "libvirtd.service";
      after = [ "carreld.socket" ] ++ lib.optional useLibvirt "libvirtd.service";

      serviceConfig = {
        Type = "notify";
        NotifyAccess = "main";
        ExecStart = utils.escapeSystemdExecArgs (
          [
            (lib.getExe' cfg.package "carreld")
            "--state-dir"
            cfg.stateDir
            # Ignored under socket activation; kept so the command line
            # says where the socket is.
            "--socket"
            cfg.socket
            "--cache-dir"
            "/var/cache/carrel"
            "--agent"
            "${cfg.package}/libexec/carrel/carrel-agent"
            "--qemu"
            (lib.getExe' cfg.qemuPackage "qemu-system-x86_64")
            "--driver"
            cfg.driver
            "--libvirt-uri"
            cfg.libvirtURI
          ]
          ++ lib.concatMap (image: [
            "--import-image"
            "${image}"
          ]) cfg.images
          ++ lib.optionals (cfg.e2bListen != null) [
            "--e2b-listen"
            cfg.e2bListen
          ]
          ++ lib.optionals (cfg.fleet.kubeconfig != null) (
            [
              "--kubeconfig"
              cfg.fleet.kubeconfig
              "--fleet-helper"
              "${cfg.package}/libexec/carrel/carrel-node"
              "--fleet-fence-after"
              cfg.fleet.fenceAfter
            ]
            ++ lib.optionals (cfg.fleet.nodeName != null) [
              "--node-name"
              cfg.fleet.nodeName
            ]
          )
          ++ cfg.extraArgs
        );
        # carreld pings the watchdog at half this interval while healthy; a
        # wedged carreld gets SIGABRT (a goroutine dump) and is restarted.
        WatchdogSec = "30s";
        Restart = "on-failure";
        RestartSec = "2s";
        # Stop and restart only carreld, never the VMs: each QEMU runs in
        # its own session and carreld reconciles with the running QEMUs when
        # it starts again, so a restart, a watchdog kill or a
        # nixos-rebuild switch leaves every agent's VM running. VMs are
        # stopped through the API. systemd logs the QEMUs as "left-over
        # process" on the next start; that is expected.
        KillMode = "process";
        # carreld gives each VM's QEMU a cgroup of its own below its own,
        # with memory, cpu and pids limits.
        Delegate = "memory cpu pids";

        StateDirectory = mkIf stateUnderVarLib (lib.removePrefix "/var/lib/" cfg.stateDir);
        StateDirectoryMode = "0700";
        ReadWritePaths = mkIf (!stateUnderVarLib) [ cfg.stateDir ];
        CacheDirectory = "carrel";
        CacheDirectoryMode = "0700";
        RuntimeDirectory = "carrel";
        RuntimeDirectoryMode = "0755";
        # /run/carrel holds the socket unit's socket (by default): keep it
        # when carreld stops.
        RuntimeDirectoryPreserve = true;
        UMask = "0077";

        # Sandbox. Everything here is inherited by QEMU, carreld's child.
        NoNewPrivileges = true;
        ProtectSystem = "strict";
        ProtectHome = true;
        PrivateTmp = true;
        ProtectKernelTunables = true;
        ProtectKernelModules = true;
        ProtectKernelLogs = true;
        ProtectControlGroups = true;
        ProtectClock = true;
        ProtectHostname = true;
        # carreld jails each QEMU in namespaces of its own (--jail-qemu).
        RestrictNamespaces = [ "mnt" "net" "ipc" "uts" ];
        RestrictRealtime = true;
        RestrictSUIDSGID = true;
        LockPersonality = true;
        SystemCallArchitectures = "native";
        SystemCallFilter = [
          # @mount is allowed: the jail is built with mount(2) and
          # pivot_root(2), in the jail's own mount namespace.
          "~@clock @cpu-emulation @debug @module @obsolete @raw-io @reboot @swap"
        ];
        SystemCallErrorNumber = "EPERM";
        # MemoryDenyWriteExecute is deliberately not set: QEMU's TCG
        # accelerator JIT-compiles guest code into writable+executable
        # memory. PrivateDevices is not set either: it would hide /dev/kvm;
        # DevicePolicy narrows device access instead.

        # AF_UNIX: the API, QMP, agent and console sockets; AF_VSOCK: the
        # guest agents. VMs have no NIC: AF_INET and AF_INET6 are carreld's
        # own, for the egress it carries for them (decided per connection by
        # their policies) and the e2b API's listener.
        RestrictAddressFamilies = [
          "AF_UNIX"
          "AF_VSOCK"
          "AF_INET"
          "AF_INET6"
        ];

        DevicePolicy = "closed";
        DeviceAllow = [
          "/dev/kvm rw"
          "/dev/vhost-vsock rw"
          # GPU passthrough (VFIO), planned: the container and the
          # /dev/vfio/<group> nodes. Inert until a device is bound to
          # vfio-pci; passthrough will also need LimitMEMLOCK raised, since
          # VFIO pins guest RAM.
          "/dev/vfio/vfio rw"
          "char-vfio rw"
        ];

        # carreld needs no capabilities for itself: the files and devices
        # it uses are root's own and it changes no kernel or network state.
        # Jailing QEMU takes these (see carreld.service): namespaces and
        # mounts, handing a VM's disks to its user, emptying QEMU's
        # bounding set, and becoming that user.
        CapabilityBoundingSet = [ "CAP_SYS_ADMIN" "CAP_CHOWN" "CAP_SETPCAP" "CAP_SETUID" "CAP_SETGID" ];
        AmbientCapabilities = "";
      };
    };
  };
}
