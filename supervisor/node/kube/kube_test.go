package kube

import (
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"

	"github.com/carrel-os/carrel/supervisor/fleet/v1alpha1"
	"github.com/carrel-os/carrel/supervisor/node"
)

// vms is carreld as the node sees it: it records creates.
type vms struct {
	mu      sync.Mutex
	created []string
	list    []node.VM
}

func (v *vms) Create(_ context.Context, name string, _ node.Spec, _ []string, labels map[string]string) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.created = append(v.created, name)
	v.list = append(v.list, node.VM{Name: name, Labels: labels, Running: true, Ready: true, Session: "ses_1"})
	return nil
}

func (v *vms) List(context.Context) ([]node.VM, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	return append([]node.VM(nil), v.list...), nil
}
func (v *vms) Stop(context.Context, string, bool) error { return nil }
func (v *vms) Delete(context.Context, string) error     { return nil }

// world is a Node over fake API clients holding one AgentVM, team/web,
// and its run's pod, bound to this host.
type world struct {
	n   *Node
	cs  *fake.Clientset
	vms *vms
	pod *corev1.Pod
}

func newWorld(t *testing.T, st v1alpha1.AgentVMStatus, dynErr error) *world {
	t.Helper()
	avm := &v1alpha1.AgentVM{TypeMeta: metav1.TypeMeta{APIVersion: v1alpha1.GroupVersion.String(), Kind: "AgentVM"},
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "team", UID: "uid-avm"},
		Spec:       v1alpha1.AgentVMSpec{Image: "base"}, Status: st}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "web-1", Namespace: "team", UID: "uid-pod",
		Labels:          map[string]string{v1alpha1.LabelAgentVM: "web"},
		OwnerReferences: []metav1.OwnerReference{{APIVersion: v1alpha1.GroupVersion.String(), Kind: "AgentVM", Name: "web", UID: "uid-avm", Controller: ptr.To(true)}}},
		Spec: corev1.PodSpec{NodeName: "carrel-h"}}
	u, err := runtime.DefaultUnstructuredConverter.ToUnstructured(avm)
	if err != nil {
		t.Fatal(err)
	}
	s := runtime.NewScheme()
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(s, map[schema.GroupVersionResource]string{
		agentVMs: "AgentVMList", policies: "PolicyList"}, &unstructured.Unstructured{Object: u})
	if dynErr != nil {
		dyn.PrependReactor("get", "agentvms", func(k8stesting.Action) (bool, runtime.Object, error) { return true, nil, dynErr })
	}
	cs := fake.NewClientset(pod.DeepCopy())
	v := &vms{}
	idx := cache.NewIndexer(cache.MetaNamespaceKeyFunc, nil)
	if err := idx.Add(pod); err != nil {
		t.Fatal(err)
	}
	n := &Node{cfg: Config{Name: "carrel-h", Agent: node.New(node.Config{VMs: v, Log: slog.New(slog.DiscardHandler)})},
		log: slog.New(slog.DiscardHandler), cs: cs, dyn: dyn, pods: idx, kick: make(chan struct{}, 1),
		devices: map[string]string{}, policies: map[types.UID]int64{}, accepted: map[types.UID]acceptedPod{}, reported: map[types.UID]string{}}
	return &world{n: n, cs: cs, vms: v, pod: pod}
}

// report is what the host last wrote in the pod's status, or nil.
func (w *world) report(t *testing.T) *v1alpha1.HostReport {
	t.Helper()
	p, err := w.cs.CoreV1().Pods("team").Get(context.Background(), "web-1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range p.Status.Conditions {
		if c.Type == v1alpha1.ConditionVM {
			var r v1alpha1.HostReport
			if err := json.Unmarshal([]byte(c.Message), &r); err != nil {
				t.Fatal(err)
			}
			return &r
		}
	}
	return nil
}

func (w *world) created() []string {
	w.vms.mu.Lock()
	defer w.vms.mu.Unlock()
	return append([]string(nil), w.vms.created...)
}

func TestAcceptedRunBoots(t *testing.T) {
	w := newWorld(t, v1alpha1.AgentVMStatus{Run: 1, Pod: "web-1", PodUID: "uid-pod"}, nil)
	// The boot runs in the background: sync until the host reports the
	// run Running, for at most 10 s.
	var r *v1alpha1.HostReport
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if err := w.n.sync(context.Background()); err != nil {
			t.Fatal(err)
		}
		if r = w.report(t); r != nil && r.Phase == string(node.Running) {
			break
		}
	}
	if r == nil || r.Phase != string(node.Running) || r.Session != "ses_1" {
		t.Errorf("report %+v, want Running in ses_1", r)
	}
	if c := w.created(); len(c) != 1 || c[0] != "web" {
		t.Fatalf("created %v, want web once", c)
	}
}

// TestNotYetRecorded: a pod its AgentVM names but whose UID the
// controller has not recorded yet is neither run nor refused.
func TestNotYetRecorded(t *testing.T) {
	w := newWorld(t, v1alpha1.AgentVMStatus{Run: 1, Pod: "web-1"}, nil)
	if err := w.n.sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	if r := w.report(t); r != nil {
		t.Errorf("report %+v, want none yet", r)
	}
	if c := w.created(); len(c) != 0 {
		t.Errorf("created %v before the run's pod was on record", c)
	}
}

// TestRefused: a pod the AgentVM does not name by UID, or at all, runs
// nothing and is reported Failed/Refused.
func TestRefused(t *testing.T) {
	for name, st := range map[string]v1alpha1.AgentVMStatus{
		"another pod's UID": {Run: 1, Pod: "web-1", PodUID: "uid-other"},
		"another run":       {Run: 2, Pod: "web-2", PodUID: "uid-other"},
	} {
		w := newWorld(t, st, nil)
		if err := w.n.sync(context.Background()); err != nil {
			t.Fatal(err)
		}
		r := w.report(t)
		if r == nil || r.Phase != string(node.Failed) || r.Reason != "Refused" {
			t.Errorf("%s: report %+v, want Failed/Refused", name, r)
		}
		if c := w.created(); len(c) != 0 {
			t.Errorf("%s: created %v", name, c)
		}
	}
}

// TestTransientNotRefused: an API error reading the AgentVM (throttled)
// fails nothing: no report, no VM, and the pod is checked again later.
func TestTransientNotRefused(t *testing.T) {
	throttled := apierrors.NewTooManyRequests("throttled", 1)
	w := newWorld(t, v1alpha1.AgentVMStatus{Run: 1, Pod: "web-1", PodUID: "uid-pod"}, throttled)
	if err := w.n.sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	if r := w.report(t); r != nil {
		t.Errorf("report %+v after a transient error, want none", r)
	}
	if _, ok := w.n.accepted[w.pod.UID]; ok {
		t.Error("a transient error was kept as the pod's answer")
	}
}

func TestDeviceName(t *testing.T) {
	if got := deviceName("0000:41:00.0"); got != "gpu-0000-41-00-0" {
		t.Errorf("deviceName = %q", got)
	}
	if strings.ContainsAny(deviceName("0000:41:00.0"), ":.") {
		t.Error("not a DNS label")
	}
}
