// Command carrel-controller places AgentVMs on carrel hosts through
// Kubernetes' scheduler (supervisor/fleet/controller). It runs in the
// cluster (carrel fleet manifests deploys it) or beside it with
// --kubeconfig; replicas elect one leader. `carrel-controller image
// --out DIR` writes its own container image, as an OCI layout.
package main

import (
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"os"

	"github.com/go-logr/logr"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/carrel-os/carrel/supervisor/fleet/controller"
	"github.com/carrel-os/carrel/supervisor/fleet/v1alpha1"
)

var version = "dev"

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "carrel-controller:", err)
		os.Exit(1)
	}
}

func run() error {
	if len(os.Args) > 1 && os.Args[1] == "image" {
		return runImage(os.Args[2:])
	}
	leaderNS := flag.String("leader-election-namespace", "carrel-system", "namespace of the leader election Lease")
	leaderElect := flag.Bool("leader-elect", true, "elect one active replica")
	lossTimeout := flag.Duration("node-loss-timeout", controller.DefaultNodeLossTimeout, "how long a host's Lease may go unrenewed before its runs are Lost; hosts fence themselves after half of it (carreld --fleet-fence-after)")
	qps := flag.Float64("kube-api-qps", 50, "requests per second to the API server, sustained")
	burst := flag.Int("kube-api-burst", 100, "requests to the API server in a burst")
	workers := flag.Int("workers", 8, "AgentVMs reconciled at once")
	metrics := flag.String("metrics-listen", "0", "address to serve Prometheus metrics on; 0 turns them off")
	health := flag.String("health-listen", "", "address to serve /healthz and /readyz on; off when empty")
	showVersion := flag.Bool("version", false, "print the version and exit")
	flag.Parse()
	if *showVersion {
		fmt.Println(version)
		return nil
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	ctrl.SetLogger(logr.FromSlogHandler(log.Handler()))

	// --kubeconfig (or $KUBECONFIG), else in-cluster: controller-runtime's
	// own flag and lookup.
	cfg, err := ctrl.GetConfig()
	if err != nil {
		return err
	}
	cfg.QPS, cfg.Burst = float32(*qps), *burst
	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{clientgoscheme.AddToScheme, v1alpha1.AddToScheme} {
		if err := add(scheme); err != nil {
			return err
		}
	}
	runs, err := labels.Parse(v1alpha1.LabelAgentVM)
	if err != nil {
		return err
	}
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Scheme:                  scheme,
		LeaderElection:          *leaderElect,
		LeaderElectionID:        "carrel-controller",
		LeaderElectionNamespace: *leaderNS,
		// A new leader waits out the old one's lease; let go at once on a
		// clean exit so that one takes over without that wait.
		LeaderElectionReleaseOnCancel: true,
		Metrics:                       server.Options{BindAddress: *metrics},
		HealthProbeBindAddress:        *health,
		Cache: cache.Options{ByObject: map[client.Object]cache.ByObject{
			// Only runs' pods, and only the hosts' Leases, are cached.
			&corev1.Pod{}:           {Label: runs},
			&coordinationv1.Lease{}: {Namespaces: map[string]cache.Config{"kube-node-lease": {}}},
		}},
	})
	if err != nil {
		return err
	}
	if err := controller.Setup(mgr, controller.Config{NodeLossTimeout: *lossTimeout, Workers: *workers}); err != nil {
		return err
	}
	if *health != "" {
		if err := mgr.AddHealthzCheck("ping", func(_ *http.Request) error { return nil }); err != nil {
			return err
		}
		if err := mgr.AddReadyzCheck("ping", func(_ *http.Request) error { return nil }); err != nil {
			return err
		}
	}
	log.Info("carrel-controller starting", "version", version, "node-loss-timeout", *lossTimeout, "leader-elect", *leaderElect)
	return mgr.Start(ctrl.SetupSignalHandler())
}

func runImage(args []string) error {
	fs := flag.NewFlagSet("image", flag.ContinueOnError)
	out := fs.String("out", "", "directory to write the OCI image layout to (new)")
	tag := fs.String("tag", "carrel-controller:"+version, "the image's name in the layout (org.opencontainers.image.ref.name)")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: carrel-controller image --out DIR [--tag NAME]\n\nWrites this binary's container image as an OCI layout; push it with, e.g.,\n  skopeo copy oci:DIR docker://REGISTRY/carrel-controller:VERSION")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *out == "" || fs.NArg() > 0 {
		fs.Usage()
		return fmt.Errorf("--out is required")
	}
	d, err := writeImage(*out, *tag)
	if err != nil {
		return err
	}
	fmt.Printf("%s %s\n", *tag, d)
	return nil
}
