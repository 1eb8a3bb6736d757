// Command carreld is the carrel host supervisor. It runs the VMs, holds the
// link to each guest agent and serves the API on a unix socket.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/bytesize"
	"github.com/carrel-os/carrel/supervisor/daemon"
	"github.com/carrel-os/carrel/supervisor/debugserver"
	"github.com/carrel-os/carrel/supervisor/driver/qemu"
	"github.com/carrel-os/carrel/supervisor/jail"
)

func main() {
	// carreld starts itself again to jail each QEMU: that child does only
	// this, and never returns.
	jail.Main()
	var cfg daemon.Config
	var level string
	flag.StringVar(&cfg.StateDir, "state-dir", "/var/lib/carrel", "directory for images, VM records and sockets")
	flag.StringVar(&cfg.Socket, "socket", "/run/carrel/carrel.sock", "unix socket to serve the API on (ignored when socket-activated)")
	flag.StringVar(&cfg.CacheDir, "cache-dir", "/var/cache/carrel", "directory for downloaded packages used by image builds")
	flag.StringVar(&cfg.AgentBinary, "agent", besideCarreld("carrel-agent"), "static carrel-agent binary put into development images")
	flag.StringVar(&cfg.QEMUBinary, "qemu", "qemu-system-x86_64", "QEMU binary")
	flag.BoolVar(&cfg.JailQEMU, "jail-qemu", true, "run each QEMU of the qemu driver as an unprivileged user of its own, in a jail that shows it only its own files (needs root)")
	flag.Func("jail-uid-base", fmt.Sprintf("the first of the %d user ids jailed QEMUs run as; none may be in /etc/passwd or /etc/group (default %d)", qemu.DefaultUIDs, qemu.DefaultUIDBase), func(v string) error {
		n, err := strconv.ParseUint(v, 0, 32)
		if err == nil && (n == 0 || n+qemu.DefaultUIDs > 1<<32-1) {
			err = errors.New("out of range")
		}
		cfg.JailUIDBase = uint32(n)
		return err
	})
	flag.StringVar(&cfg.Machine, "machine", "auto", "QEMU machine type: microvm, q35, or auto (microvm under KVM, q35 under TCG)")
	flag.StringVar(&cfg.Driver, "driver", daemon.DriverQEMU, "how new VMs run: qemu (QEMU started by carreld) or libvirt (domains of libvirtd); existing VMs keep theirs")
	flag.StringVar(&cfg.LibvirtURI, "libvirt-uri", "qemu:///system", "libvirt connection URI for the libvirt driver")
	flag.DurationVar(&cfg.BootTimeout, "boot-timeout", 90*time.Second, "longest a VM may take from start to agent ready")
	flag.StringVar(&cfg.EgressHosts, "egress-hosts", "", "hosts(5) file that resolves the names VMs reach, instead of DNS (tests, air-gapped sites)")
	flag.Func("import-image", "image directory to import at start, tagged with its name; repeat for more (an image already stored is left as it is)", func(v string) error {
		cfg.ImportImages = append(cfg.ImportImages, v)
		return nil
	})
	flag.StringVar(&cfg.E2BListen, "e2b-listen", "", "serve the e2b API (control plane and envd, for unmodified e2b SDKs) on this TCP address, e.g. 127.0.0.1:3000; off when empty")
	flag.Int64Var(&cfg.E2BMaxUpload, "e2b-max-upload", 0, "largest file upload the e2b API takes, in bytes (0: 1 GiB)")
	flag.StringVar(&cfg.AuditOrigin, "audit-origin", "", "the origin of a new audit log: its key's name and its checkpoints' first line, e.g. carrel.example.com/host1 (default carrel-audit); witnesses that serve several hosts need each host's own. An existing log keeps its own")
	flag.Func("audit-segment-size", "roll the audit log's records.log over into segments/ once it holds this much, e.g. 128M (the default) or 1G; a plain number is bytes", func(v string) error {
		n, err := bytesize.Parse(v)
		if err != nil {
			return err
		}
		if n == 0 || n > 1<<62 {
			return fmt.Errorf("segment size %q: want 1 byte to 4 EiB", v)
		}
		cfg.AuditSegmentBytes = int64(n)
		return nil
	})
	flag.DurationVar(&cfg.AuditSegmentAge, "audit-segment-age", audit.DefaultSegmentAge, "roll the audit log's records.log over once its first record is older than this, e.g. 24h")
	flag.Func("witness", "a witness that cosigns the audit log's checkpoints, as URL,KEY (its C2SP tlog-witness URL and cosignature/v1 key, e.g. from carrel witness keygen); repeat for more", func(v string) error {
		cfg.Witnesses = append(cfg.Witnesses, v)
		return nil
	})
	var fleet daemon.FleetConfig
	flag.StringVar(&fleet.Kubeconfig, "kubeconfig", "", "join a Kubernetes fleet: the kubeconfig of this host's Node identity (user system:node:NAME in group system:nodes); carreld registers the Node, renews its Lease, publishes its GPUs and boots the AgentVM runs placed on it. Off when empty")
	flag.StringVar(&fleet.NodeName, "node-name", "", "the fleet Node's name (default carrel-HOSTNAME)")
	flag.DurationVar(&fleet.FenceAfter, "fleet-fence-after", 30*time.Second, "stop this host's fleet VMs, and refuse their calls, once the Node's Lease has gone unrenewed this long; keep it well under carrel-controller's --node-loss-timeout (60s)")
	flag.DurationVar(&fleet.RenewInterval, "fleet-renew-interval", 10*time.Second, "how often the Node's Lease is renewed")
	flag.StringVar(&fleet.Helper, "fleet-helper", besideCarreld("carrel-node"), "the carrel-node binary, carreld's Kubernetes node helper")
	flag.Int64Var(&fleet.CPUs, "fleet-cpus", 0, "CPUs the fleet may place on this host (default: all of them)")
	flag.Func("fleet-memory", "memory the fleet may place on this host, e.g. 64G (default: all of it)", func(v string) error {
		n, err := bytesize.Parse(v)
		fleet.Memory = int64(n)
		return err
	})
	flag.StringVar(&fleet.FakeGPUs, "fleet-fake-gpus", "", "tests only: publish the GPUs of the fake sysfs at this root, and boot VMs without the GPUs allocated to them")
	flag.StringVar(&level, "log-level", "info", "debug, info, warn or error")
	var debugSocket string
	flag.StringVar(&debugSocket, "debug-socket", "", "serve Go's runtime profiles (net/http/pprof: goroutines, heap, CPU) on this unix socket, mode 0600, for load tests and leak hunts; off when empty. Put it in a directory only root can reach")
	version := flag.Bool("version", false, "print the version and exit")
	config := flag.String("config", "", "JSON file of settings named as these flags, e.g. {\"driver\": \"libvirt\"}; flags given here win")
	flag.Parse()
	if *version {
		fmt.Println("carreld", daemon.Version)
		return
	}
	if *config != "" {
		if err := applyConfig(flag.CommandLine, *config, "config", "version"); err != nil {
			fmt.Fprintln(os.Stderr, "carreld:", err)
			os.Exit(2)
		}
	}
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		fmt.Fprintln(os.Stderr, "carreld: bad --log-level:", err)
		os.Exit(2)
	}
	if cfg.Machine != "auto" && cfg.Machine != "microvm" && cfg.Machine != "q35" {
		fmt.Fprintln(os.Stderr, "carreld: --machine must be auto, microvm or q35")
		os.Exit(2)
	}
	if cfg.Driver != daemon.DriverQEMU && cfg.Driver != daemon.DriverLibvirt {
		fmt.Fprintln(os.Stderr, "carreld: --driver must be qemu or libvirt")
		os.Exit(2)
	}
	// Image builds run tools in other working directories, so every path
	// given on the command line is made absolute once, here.
	if fleet.Kubeconfig != "" {
		cfg.Fleet = &fleet
	}
	for _, p := range []*string{&cfg.StateDir, &cfg.Socket, &cfg.CacheDir, &cfg.AgentBinary, &cfg.EgressHosts, &debugSocket, &fleet.Kubeconfig, &fleet.FakeGPUs, &fleet.Helper} {
		if *p == "" {
			continue
		}
		abs, err := filepath.Abs(*p)
		if err != nil {
			fmt.Fprintln(os.Stderr, "carreld:", err)
			os.Exit(2)
		}
		*p = abs
	}
	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lv}))
	slog.SetDefault(cfg.Logger)

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if debugSocket != "" {
		if err := serveDebug(ctx, debugSocket, cfg.Logger); err != nil {
			cfg.Logger.Error("carreld failed", "err", err)
			os.Exit(1)
		}
	}
	if err := daemon.Run(ctx, cfg); err != nil {
		cfg.Logger.Error("carreld failed", "err", err)
		os.Exit(1)
	}
}

// besideCarreld is the named binary beside carreld's own, else its
// packaged location in /usr/libexec/carrel: carrel-agent, carrel-node.
func besideCarreld(name string) string {
	if exe, err := os.Executable(); err == nil {
		p := filepath.Join(filepath.Dir(exe), name)
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return filepath.Join("/usr/libexec/carrel", name)
}

// serveDebug starts the profiles server on a unix socket at path, replacing
// a socket a killed carreld left there.
func serveDebug(ctx context.Context, path string, log *slog.Logger) error {
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		return fmt.Errorf("debug socket: %w", err)
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		return fmt.Errorf("debug socket: %w", err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return fmt.Errorf("debug socket: %w", err)
	}
	log.Warn("serving runtime profiles on the debug socket", "path", path)
	go func() {
		if err := debugserver.Serve(ctx, l); err != nil {
			log.Error("debug socket", "err", err)
		}
	}()
	return nil
}
