// Package manifests holds what a cluster needs for carrel's fleet: the
// carrel.dev CRDs (made by controller-gen from supervisor/fleet/v1alpha1),
// the GPUs' DeviceClass, carrel-controller's Deployment and the RBAC of
// the controller and of the hosts. carrel fleet manifests prints them,
// from the binary of the same version.
package manifests

import (
	"bytes"
	"embed"
	"fmt"
	"io/fs"
	"slices"
	"text/template"
	"time"
)

//go:embed crd/*.yaml
var crds embed.FS

//go:embed fleet.yaml.tmpl
var fleetTmpl string

// Options fill the manifests in.
type Options struct {
	// Namespace holds the controller (carrel-system).
	Namespace string
	// Image is the controller's container image.
	Image string
	// NodeLossTimeout is the controller's --node-loss-timeout.
	NodeLossTimeout time.Duration
	// Controller includes the controller's Deployment; without it the
	// controller runs outside the cluster, with --kubeconfig.
	Controller bool
	// Version names the carrel that made them.
	Version string
}

// CRDs returns the CRDs, each a YAML document.
func CRDs() ([]byte, error) {
	names, err := fs.Glob(crds, "crd/*.yaml")
	if err != nil {
		return nil, err
	}
	slices.Sort(names)
	var out bytes.Buffer
	for _, n := range names {
		b, err := crds.ReadFile(n)
		if err != nil {
			return nil, err
		}
		out.Write(b)
	}
	return out.Bytes(), nil
}

// Render returns every manifest, the CRDs first, as one YAML stream.
func Render(o Options) ([]byte, error) {
	if o.Namespace == "" {
		o.Namespace = "carrel-system"
	}
	if o.NodeLossTimeout == 0 {
		o.NodeLossTimeout = 60 * time.Second
	}
	if o.Controller && o.Image == "" {
		return nil, fmt.Errorf("the controller's image is required")
	}
	t, err := template.New("fleet").Option("missingkey=error").Parse(fleetTmpl)
	if err != nil {
		return nil, err
	}
	out, err := CRDs()
	if err != nil {
		return nil, err
	}
	var b bytes.Buffer
	if err := t.Execute(&b, o); err != nil {
		return nil, err
	}
	return append(out, b.Bytes()...), nil
}
