package controller

import (
	"context"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/carrel-os/carrel/supervisor/fleet/v1alpha1"
)

const lossTimeout = time.Minute

// fleet is a Reconciler over a fake API server holding one AgentVM,
// team/web, with a clock that moves only when told.
type fleet struct {
	t   *testing.T
	r   *Reconciler
	clk *clock
}

func newFleet(t *testing.T, avm *v1alpha1.AgentVM, objs ...client.Object) *fleet {
	t.Helper()
	s := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	if err := v1alpha1.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	c := fake.NewClientBuilder().WithScheme(s).WithObjects(append(objs, avm)...).
		WithStatusSubresource(&v1alpha1.AgentVM{}).Build()
	clk := newClock()
	r := &Reconciler{Client: c, cfg: Config{NodeLossTimeout: lossTimeout, now: clk.now}, leases: newLeases(clk.now),
		events: events.NewFakeRecorder(16)}
	return &fleet{t: t, r: r, clk: clk}
}

func agentVM(onNodeLoss v1alpha1.NodeLossAction, st v1alpha1.AgentVMStatus) *v1alpha1.AgentVM {
	return &v1alpha1.AgentVM{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "team", UID: "uid-web"},
		Spec:       v1alpha1.AgentVMSpec{Image: "base", OnNodeLoss: onNodeLoss},
		Status:     st,
	}
}

func (f *fleet) reconcile() reconcile.Result {
	f.t.Helper()
	res, err := f.r.Reconcile(context.Background(), reconcile.Request{NamespacedName: types.NamespacedName{Namespace: "team", Name: "web"}})
	if err != nil {
		f.t.Fatalf("Reconcile: %v", err)
	}
	return res
}

func (f *fleet) status() v1alpha1.AgentVMStatus {
	f.t.Helper()
	var avm v1alpha1.AgentVM
	if err := f.r.Get(context.Background(), types.NamespacedName{Namespace: "team", Name: "web"}, &avm); err != nil {
		f.t.Fatal(err)
	}
	return avm.Status
}

func (f *fleet) pods() []corev1.Pod {
	f.t.Helper()
	var list corev1.PodList
	if err := f.r.List(context.Background(), &list, client.InNamespace("team")); err != nil {
		f.t.Fatal(err)
	}
	return list.Items
}

// runPod is the pod of avm's current run as the controller makes it,
// bound to node, with the host's report rep.
func (f *fleet) runPod(avm *v1alpha1.AgentVM, node string, rep v1alpha1.HostReport) *corev1.Pod {
	f.t.Helper()
	p := PodFor(avm, &avm.Status)
	p.UID = "uid-pod"
	p.Spec.NodeName = node
	p.Status.Conditions = []corev1.PodCondition{reportCondition(f.t, rep)}
	if err := controllerutil.SetControllerReference(avm, p, f.r.Scheme()); err != nil {
		f.t.Fatal(err)
	}
	return p
}

func TestReconcileNewRun(t *testing.T) {
	avm := agentVM(v1alpha1.NodeLossFail, v1alpha1.AgentVMStatus{})
	f := newFleet(t, avm)

	f.reconcile()
	if st := f.status(); st.Run != 1 || st.Pod != "web-1" || st.Phase != v1alpha1.PhasePending {
		t.Fatalf("status %+v, want run 1, pod web-1, Pending", st)
	}
	if pods := f.pods(); len(pods) != 0 {
		t.Fatalf("%d pods before the run was named in the status, want none", len(pods))
	}

	for range 2 {
		f.reconcile()
		pods := f.pods()
		if len(pods) != 1 || pods[0].Name != "web-1" {
			t.Fatalf("pods %v, want web-1 alone", podNames(pods))
		}
		if ref := metav1.GetControllerOf(&pods[0]); ref == nil || ref.UID != avm.UID || ref.Kind != "AgentVM" {
			t.Errorf("pod's controller %+v, want the AgentVM", ref)
		}
	}
	if st := f.status(); st.Run != 1 || st.Phase != v1alpha1.PhasePending {
		t.Errorf("status %+v, want run 1 still Pending", st)
	}
}

func TestReconcilePodGone(t *testing.T) {
	placed := v1alpha1.AgentVMStatus{Run: 1, Pod: "web-1", Phase: v1alpha1.PhaseRunning, Node: "host-a", Session: "s-1"}

	f := newFleet(t, agentVM(v1alpha1.NodeLossFail, placed))
	f.reconcile()
	if st := f.status(); st.Run != 1 || st.Phase != v1alpha1.PhaseStopped {
		t.Errorf("Fail: status %+v, want run 1 Stopped", st)
	}
	f.reconcile()
	if pods := f.pods(); len(pods) != 0 {
		t.Errorf("Fail: pods %v, want none", podNames(pods))
	}

	f = newFleet(t, agentVM(v1alpha1.NodeLossRecreate, placed))
	f.reconcile()
	if st := f.status(); st.Run != 2 || st.Pod != "web-2" || st.Phase != v1alpha1.PhasePending || st.Node != "" || st.Session != "" {
		t.Errorf("Recreate: status %+v, want run 2, pod web-2, Pending, on no host yet", st)
	}
	f.reconcile()
	if pods := f.pods(); len(pods) != 1 || pods[0].Name != "web-2" {
		t.Errorf("Recreate: pods %v, want web-2", podNames(pods))
	}
}

func TestReconcileNodeLost(t *testing.T) {
	for _, how := range []v1alpha1.NodeLossAction{v1alpha1.NodeLossFail, v1alpha1.NodeLossRecreate} {
		avm := agentVM(how, v1alpha1.AgentVMStatus{Run: 1, Pod: "web-1", Phase: v1alpha1.PhaseRunning, Node: "host-a"})
		f := newFleet(t, avm)
		if err := f.r.Create(context.Background(), f.runPod(avm, "host-a", v1alpha1.HostReport{Phase: "Running", Session: "s-1"})); err != nil {
			t.Fatal(err)
		}

		if res := f.reconcile(); res.RequeueAfter != lossTimeout/4 {
			t.Errorf("%s: a placed run is looked at again after %s, want %s", how, res.RequeueAfter, lossTimeout/4)
		}
		f.clk.advance(lossTimeout)
		f.reconcile()
		if st := f.status(); st.Phase != v1alpha1.PhaseRunning || len(f.pods()) != 1 {
			t.Fatalf("%s: host silent for the timeout, not over it: status %+v", how, st)
		}

		f.clk.advance(time.Second)
		f.reconcile()
		st := f.status()
		if pods := f.pods(); len(pods) != 0 {
			t.Errorf("%s: pods %v of a lost host, want deleted", how, podNames(pods))
		}
		if !slices.Equal(st.LostNodes, []string{"host-a"}) {
			t.Errorf("%s: lost nodes %v, want host-a", how, st.LostNodes)
		}
		switch how {
		case v1alpha1.NodeLossFail:
			if st.Run != 1 || st.Phase != v1alpha1.PhaseLost {
				t.Errorf("Fail: status %+v, want run 1 Lost", st)
			}
		case v1alpha1.NodeLossRecreate:
			if st.Run != 2 || st.Phase != v1alpha1.PhasePending {
				t.Errorf("Recreate: status %+v, want run 2 Pending", st)
			}
			f.reconcile()
			if pods := f.pods(); len(pods) != 1 || pods[0].Name != "web-2" || pods[0].Spec.Affinity == nil {
				t.Errorf("Recreate: pods %v, want web-2 kept off host-a", podNames(pods))
			}
		}
	}
}

func TestReconcileHostFenced(t *testing.T) {
	avm := agentVM(v1alpha1.NodeLossFail, v1alpha1.AgentVMStatus{Run: 1, Pod: "web-1", Phase: v1alpha1.PhaseRunning, Node: "host-a"})
	f := newFleet(t, avm)
	if err := f.r.Create(context.Background(), f.runPod(avm, "host-a", v1alpha1.HostReport{Phase: "Failed", Reason: "Fenced"})); err != nil {
		t.Fatal(err)
	}
	f.reconcile()
	if st := f.status(); st.Phase != v1alpha1.PhaseLost || !slices.Equal(st.LostNodes, []string{"host-a"}) || len(f.pods()) != 0 {
		t.Errorf("status %+v, %d pods: want Lost on host-a at once, and its pod deleted", st, len(f.pods()))
	}
}

func podNames(pods []corev1.Pod) []string {
	var out []string
	for _, p := range pods {
		out = append(out, p.Name)
	}
	return out
}
