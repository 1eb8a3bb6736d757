package main

import (
	"time"

	"github.com/spf13/cobra"

	"github.com/carrel-os/carrel/supervisor/fleet/manifests"
)

func newFleetCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "fleet",
		Short: "Run carrel across many hosts on Kubernetes",
	}
	var o manifests.Options
	noController := false
	m := &cobra.Command{
		Use:   "manifests",
		Short: "Print the CRDs, DeviceClass, RBAC and carrel-controller Deployment, for kubectl apply -f -",
		Long: `Print what a cluster needs for carrel's fleet, made by this carrel: the carrel.dev
CRDs (AgentVM, Policy), the gpu.carrel.dev DeviceClass, carrel-controller's
Deployment and RBAC, and the hosts' RBAC (group carrel:nodes). Apply it with
  carrel fleet manifests | kubectl apply --server-side -f -
Each host then runs carreld --kubeconfig with its Node's own credentials.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			o.Controller, o.Version = !noController, version
			b, err := manifests.Render(o)
			if err != nil {
				return err
			}
			_, err = cmd.OutOrStdout().Write(b)
			return err
		},
	}
	m.Flags().StringVar(&o.Namespace, "namespace", "carrel-system", "namespace of carrel-controller")
	m.Flags().StringVar(&o.Image, "image", "carrel-controller:"+version, "carrel-controller's container image")
	m.Flags().DurationVar(&o.NodeLossTimeout, "node-loss-timeout", 60*time.Second, "carrel-controller's --node-loss-timeout; hosts' --fleet-fence-after must be well under it")
	m.Flags().BoolVar(&noController, "no-controller", false, "leave the Deployment out (run carrel-controller --kubeconfig outside the cluster)")
	cmd.AddCommand(m)
	return cmd
}
