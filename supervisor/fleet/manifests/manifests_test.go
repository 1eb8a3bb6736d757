package manifests

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

// render renders o and parses the stream into its objects, failing on
// any document that is not one.
func render(t *testing.T, o Options) []*unstructured.Unstructured {
	t.Helper()
	b, err := Render(o)
	if err != nil {
		t.Fatal(err)
	}
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(b)))
	var out []*unstructured.Unstructured
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		u := &unstructured.Unstructured{}
		if err := yaml.Unmarshal(doc, &u.Object); err != nil {
			t.Fatalf("document %d: %v\n%s", len(out), err, doc)
		}
		if u.Object == nil {
			continue // comments alone
		}
		if u.GetAPIVersion() == "" || u.GetKind() == "" || u.GetName() == "" {
			t.Fatalf("document %d lacks apiVersion, kind or metadata.name:\n%s", len(out), doc)
		}
		out = append(out, u)
	}
}

func kinds(objs []*unstructured.Unstructured) []string {
	var out []string
	for _, o := range objs {
		out = append(out, o.GetKind()+"/"+o.GetName())
	}
	return out
}

// namespaced are the kinds Render puts in the controller's namespace.
var namespaced = []string{"ServiceAccount", "Role", "RoleBinding", "Deployment"}

func TestRender(t *testing.T) {
	const ns = "fleet-x"
	objs := render(t, Options{Namespace: ns, Image: "registry.example/carrel-controller:v1", Controller: true,
		NodeLossTimeout: 90 * time.Second, Version: "v1.2.3"})
	want := []string{
		"CustomResourceDefinition/agentvms.carrel.dev",
		"CustomResourceDefinition/policies.carrel.dev",
		"Namespace/" + ns,
		"DeviceClass/gpu.carrel.dev",
		"ServiceAccount/carrel-controller",
		"ClusterRole/carrel:controller",
		"ClusterRoleBinding/carrel:controller",
		"Role/carrel:controller-leader",
		"RoleBinding/carrel:controller-leader",
		"ClusterRole/carrel:node",
		"ClusterRoleBinding/carrel:node",
		"Deployment/carrel-controller",
	}
	if got := kinds(objs); !slices.Equal(got, want) {
		t.Fatalf("objects\n%q\nwant\n%q", got, want)
	}

	for _, o := range objs {
		wantNS := ""
		if slices.Contains(namespaced, o.GetKind()) {
			wantNS = ns
		}
		if o.GetNamespace() != wantNS {
			t.Errorf("%s/%s: namespace %q, want %q", o.GetKind(), o.GetName(), o.GetNamespace(), wantNS)
		}
		subjects, _, _ := unstructured.NestedSlice(o.Object, "subjects")
		for _, s := range subjects {
			s := s.(map[string]any)
			if s["kind"] == "ServiceAccount" && s["namespace"] != ns {
				t.Errorf("%s/%s: subject %v, want in namespace %q", o.GetKind(), o.GetName(), s, ns)
			}
		}
	}

	d := objs[len(objs)-1]
	containers, _, _ := unstructured.NestedSlice(d.Object, "spec", "template", "spec", "containers")
	if len(containers) != 1 {
		t.Fatalf("%d containers, want 1", len(containers))
	}
	c := containers[0].(map[string]any)
	args, _, _ := unstructured.NestedStringSlice(c, "args")
	if c["image"] != "registry.example/carrel-controller:v1" ||
		!slices.Contains(args, "--leader-election-namespace="+ns) || !slices.Contains(args, "--node-loss-timeout=1m30s") {
		t.Errorf("controller image %v, args %q", c["image"], args)
	}
}

func TestRenderWithoutController(t *testing.T) {
	objs := render(t, Options{})
	if slices.ContainsFunc(objs, func(o *unstructured.Unstructured) bool { return o.GetKind() == "Deployment" }) {
		t.Errorf("a Deployment without Controller: %q", kinds(objs))
	}
	for _, o := range objs {
		if o.GetNamespace() != "" && o.GetNamespace() != "carrel-system" {
			t.Errorf("%s/%s: namespace %q, want the default, carrel-system", o.GetKind(), o.GetName(), o.GetNamespace())
		}
	}
	if !slices.Contains(kinds(objs), "Namespace/carrel-system") {
		t.Errorf("no namespace carrel-system: %q", kinds(objs))
	}
}

func TestRenderNamespaceEverywhere(t *testing.T) {
	b, err := Render(Options{Namespace: "fleet-x", Image: "img", Controller: true})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(b), "carrel-system") {
		t.Error("the default namespace is named in manifests for another")
	}
}

func TestRenderControllerNeedsImage(t *testing.T) {
	if b, err := Render(Options{Controller: true}); err == nil {
		t.Errorf("Render with Controller and no Image: no error, %d bytes", len(b))
	}
}
