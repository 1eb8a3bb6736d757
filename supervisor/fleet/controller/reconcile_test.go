package controller

import (
	"context"
	"slices"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/carrel-os/carrel/supervisor/fleet/v1alpha1"
	"github.com/carrel-os/carrel/supervisor/internal/clocktest"
)

const lossTimeout = time.Minute

// fleet is a Reconciler over a fake API server holding one AgentVM,
// team/web, with a clock that moves only when told.
type fleet struct {
	t   *testing.T
	r   *Reconciler
	clk *clocktest.Clock
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
		WithStatusSubresource(&v1alpha1.AgentVM{}).
		WithIndex(&corev1.Pod{}, indexOwner, ownerOf).WithIndex(&v1alpha1.AgentVM{}, indexNode, nodeOf).Build()
	clk := newClock()
	r := &Reconciler{Client: c, reader: c, cfg: Config{NodeLossTimeout: lossTimeout, now: clk.Now}, leases: newLeases(clk.Now),
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
	p.UID = avm.Status.PodUID
	p.Spec.NodeName = node
	p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionTrue}, reportCondition(f.t, rep)}
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
	placed := v1alpha1.AgentVMStatus{Run: 1, Pod: "web-1", PodUID: "uid-pod", Phase: v1alpha1.PhaseRunning, Node: "host-a", Session: "s-1"}

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
		avm := agentVM(how, v1alpha1.AgentVMStatus{Run: 1, Pod: "web-1", PodUID: "uid-pod", Phase: v1alpha1.PhaseRunning, Node: "host-a"})
		f := newFleet(t, avm)
		if err := f.r.Create(context.Background(), f.runPod(avm, "host-a", v1alpha1.HostReport{Phase: "Running", Session: "s-1"})); err != nil {
			t.Fatal(err)
		}

		if res := f.reconcile(); res.RequeueAfter != 0 {
			t.Errorf("%s: a placed run polled every %s: watchLoss wakes it", how, res.RequeueAfter)
		}
		f.clk.Advance(lossTimeout)
		f.reconcile()
		if st := f.status(); st.Phase != v1alpha1.PhaseRunning || len(f.pods()) != 1 {
			t.Fatalf("%s: host silent for the timeout, not over it: status %+v", how, st)
		}

		f.clk.Advance(time.Second)
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
	avm := agentVM(v1alpha1.NodeLossFail, v1alpha1.AgentVMStatus{Run: 1, Pod: "web-1", PodUID: "uid-pod", Phase: v1alpha1.PhaseRunning, Node: "host-a"})
	f := newFleet(t, avm)
	if err := f.r.Create(context.Background(), f.runPod(avm, "host-a", v1alpha1.HostReport{Phase: "Failed", Reason: "Fenced"})); err != nil {
		t.Fatal(err)
	}
	f.reconcile()
	if st := f.status(); st.Phase != v1alpha1.PhaseLost || !slices.Equal(st.LostNodes, []string{"host-a"}) || len(f.pods()) != 0 {
		t.Errorf("status %+v, %d pods: want Lost on host-a at once, and its pod deleted", st, len(f.pods()))
	}
}

// TestReconcileSquattedPod: a pod of the run's name that is not the pod
// the controller makes (bound by hand, past the scheduler) is deleted,
// and the next run named.
func TestReconcileSquattedPod(t *testing.T) {
	avm := agentVM(v1alpha1.NodeLossFail, v1alpha1.AgentVMStatus{Run: 1, Pod: "web-1", Phase: v1alpha1.PhasePending})
	f := newFleet(t, avm)
	p := f.runPod(avm, "host-x", v1alpha1.HostReport{Phase: "Running"})
	p.UID = "uid-squatter"
	p.Status.Conditions = nil // bound without the scheduler
	if err := f.r.Create(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	f.reconcile()
	if st := f.status(); st.Run != 2 || st.Pod != "web-2" || st.PodUID != "" {
		t.Fatalf("status %+v, want run 2 named", st)
	}
	if pods := f.pods(); len(pods) != 0 {
		t.Fatalf("pods %v, want the squatter gone", podNames(pods))
	}
	f.reconcile()
	pods := f.pods()
	if len(pods) != 1 || pods[0].Name != "web-2" || pods[0].Spec.NodeName != "" {
		t.Fatalf("pods %v, want web-2, unbound", podNames(pods))
	}
	if st := f.status(); st.PodUID != pods[0].UID {
		t.Errorf("pod UID on record %q, want %q", st.PodUID, pods[0].UID)
	}
}

// TestReconcileDrainWaitsForHost: a run's pod being deleted is held by
// its finalizer until the host reports its VM gone; only then does the
// next run start.
func TestReconcileDrainWaitsForHost(t *testing.T) {
	avm := agentVM(v1alpha1.NodeLossRecreate, v1alpha1.AgentVMStatus{Run: 1, Pod: "web-1", PodUID: "uid-pod", Phase: v1alpha1.PhaseRunning, Node: "host-a"})
	f := newFleet(t, avm)
	ctx := context.Background()
	if err := f.r.Create(ctx, f.runPod(avm, "host-a", v1alpha1.HostReport{Phase: "Running"})); err != nil {
		t.Fatal(err)
	}
	if err := f.r.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "host-a"}}); err != nil {
		t.Fatal(err)
	}
	f.leasesHeard("host-a")
	var p corev1.Pod
	if err := f.r.Get(ctx, types.NamespacedName{Namespace: "team", Name: "web-1"}, &p); err != nil {
		t.Fatal(err)
	}
	if err := f.r.Delete(ctx, &p); err != nil { // an eviction
		t.Fatal(err)
	}
	f.reconcile()
	if st := f.status(); st.Run != 1 || st.Phase != v1alpha1.PhaseStopping || len(f.pods()) != 1 {
		t.Fatalf("status %+v, %d pods: want run 1 Stopping, its pod held", st, len(f.pods()))
	}
	if err := f.r.Get(ctx, types.NamespacedName{Namespace: "team", Name: "web-1"}, &p); err != nil {
		t.Fatal(err)
	}
	p.Status.Conditions = []corev1.PodCondition{reportCondition(t, v1alpha1.HostReport{Phase: "Gone"})}
	if err := f.r.Status().Update(ctx, &p); err != nil {
		t.Fatal(err)
	}
	f.reconcile() // lets go of the pod
	f.reconcile() // the run has ended: the next one
	if st := f.status(); st.Run != 2 || st.Phase != v1alpha1.PhasePending {
		t.Fatalf("status %+v, want run 2 once the host let go", st)
	}
}

// leasesHeard makes the controller see node's Lease renewed now.
func (f *fleet) leasesHeard(node string) {
	now := metav1.NewMicroTime(f.clk.Now())
	f.r.leases.observe(&coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: node}, Spec: coordinationv1.LeaseSpec{RenewTime: &now}})
}

func podNames(pods []corev1.Pod) []string {
	var out []string
	for _, p := range pods {
		out = append(out, p.Name)
	}
	return out
}

// TestWatchLoss: a host silent past the timeout wakes its AgentVMs once
// per silence, and a host that renews does not.
func TestWatchLoss(t *testing.T) {
	avm := agentVM(v1alpha1.NodeLossFail, v1alpha1.AgentVMStatus{Run: 1, Pod: "web-1", PodUID: "uid-pod", Phase: v1alpha1.PhaseRunning, Node: "host-a"})
	f := newFleet(t, avm)
	f.leasesHeard("host-a")
	f.leasesHeard("host-b")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	out := make(chan event.GenericEvent, 8)
	go f.r.watchLoss(ctx, out)
	select {
	case ev := <-out:
		t.Fatalf("woke %s while its host renews", ev.Object.GetName())
	case <-time.After(1500 * time.Millisecond):
	}
	f.clk.Advance(lossTimeout + time.Second)
	select {
	case ev := <-out:
		if ev.Object.GetName() != "web" {
			t.Fatalf("woke %s", ev.Object.GetName())
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the AgentVM of a silent host was not woken")
	}
	select {
	case ev := <-out:
		t.Fatalf("woke %s twice for one silence", ev.Object.GetName())
	case <-time.After(1500 * time.Millisecond):
	}
}
