// Package controller is carrel-controller: it places each AgentVM's runs
// through Kubernetes' own scheduler and mirrors them into the AgentVM.
//
// A run is one Pod, <name>-<run>, that no kubelet runs: it carries the
// VM's requests, a claim for its GPUs, and tolerations that keep it on a
// silent host, since evicting it would destroy the VM. Its host's carreld
// (supervisor/node/kube) boots the VM and reports it in the pod's status.
// The controller names the run in the AgentVM's status before it makes
// the pod, so a controller killed in between makes the same pod again,
// never a second one, and a host runs only the pod its AgentVM names.
//
// A host whose Lease goes unrenewed for NodeLossTimeout is lost: its runs
// are Lost, their pods deleted, and an AgentVM with onNodeLoss Recreate
// gets a new run, a new session from the image, kept off the lost host.
// By then the host has fenced itself (supervisor/node), so no agent runs
// in two places.
package controller

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	"github.com/carrel-os/carrel/supervisor/fleet/v1alpha1"
)

// Defaults.
const (
	DefaultNodeLossTimeout = 60 * time.Second
	// PodMemoryOverhead is added to a run's memory request: QEMU's own.
	PodMemoryOverhead = 256 << 20
	// podGracePeriod bounds a host's graceful stop of a run's VM.
	podGracePeriod = 60
	// indexNode indexes AgentVMs by status.node; indexOwner, pods by the
	// AgentVM that controls them.
	indexNode  = "status.node"
	indexOwner = "agentvm"
)

// Config configures the controller.
type Config struct {
	// NodeLossTimeout is how long a host's Lease may go unrenewed before
	// its runs are Lost. Hosts fence themselves well before it.
	NodeLossTimeout time.Duration
	// Workers is how many AgentVMs are reconciled at once (1 when 0).
	Workers int
	// now is the clock; tests replace it.
	now func() time.Time
}

// Reconciler reconciles AgentVMs.
type Reconciler struct {
	client.Client
	// reader reads the API server, not the cache.
	reader client.Reader
	cfg    Config
	leases *leases
	events events.EventRecorder
}

// Setup adds the controller to mgr.
func Setup(mgr ctrl.Manager, cfg Config) error {
	if cfg.NodeLossTimeout == 0 {
		cfg.NodeLossTimeout = DefaultNodeLossTimeout
	}
	if cfg.now == nil {
		cfg.now = time.Now
	}
	r := &Reconciler{Client: mgr.GetClient(), reader: mgr.GetAPIReader(), cfg: cfg, leases: newLeases(cfg.now),
		events: mgr.GetEventRecorder("carrel-controller")}
	idx := mgr.GetFieldIndexer()
	if err := idx.IndexField(context.Background(), &v1alpha1.AgentVM{}, indexNode, nodeOf); err != nil {
		return err
	}
	if err := idx.IndexField(context.Background(), &corev1.Pod{}, indexOwner, ownerOf); err != nil {
		return err
	}
	// Hosts that go silent: their AgentVMs are looked at once their
	// time is up, by one watcher, not by each AgentVM polling.
	lost := make(chan event.GenericEvent, 1024)
	if err := mgr.Add(manager.RunnableFunc(func(ctx context.Context) error {
		r.watchLoss(ctx, lost)
		return nil
	})); err != nil {
		return err
	}
	return ctrl.NewControllerManagedBy(mgr).
		Named("agentvm").
		WithOptions(controller.Options{MaxConcurrentReconciles: max(cfg.Workers, 1)}).
		For(&v1alpha1.AgentVM{}).
		Owns(&corev1.Pod{}).
		Watches(&coordinationv1.Lease{}, handler.EnqueueRequestsFromMapFunc(r.leaseChanged)).
		WatchesRawSource(source.Channel(lost, &handler.EnqueueRequestForObject{})).
		Complete(r)
}

// nodeOf indexes an AgentVM by its host.
func nodeOf(o client.Object) []string {
	if n := o.(*v1alpha1.AgentVM).Status.Node; n != "" {
		return []string{n}
	}
	return nil
}

// ownerOf indexes a pod by the AgentVM that controls it.
func ownerOf(o client.Object) []string {
	if ref := metav1.GetControllerOf(o); ref != nil && ref.Kind == "AgentVM" {
		return []string{ref.Name}
	}
	return nil
}

// leaseChanged notes a host's renewal. It wakes no AgentVM: a renewal
// changes nothing for them (watchLoss wakes them when renewals stop).
func (r *Reconciler) leaseChanged(ctx context.Context, o client.Object) []reconcile.Request {
	if l, ok := o.(*coordinationv1.Lease); ok && l.Namespace == "kube-node-lease" {
		r.leases.observe(l)
	}
	return nil
}

// watchLoss wakes the AgentVMs of each host whose Lease has gone
// unrenewed past the timeout, once per silence, checking every second.
func (r *Reconciler) watchLoss(ctx context.Context, out chan<- event.GenericEvent) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	woken := map[string]string{} // host -> the renewal it was woken after
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, node := range r.leases.silentOver(r.cfg.NodeLossTimeout) {
			renew := r.leases.renewal(node)
			if w, ok := woken[node]; ok && w == renew {
				continue
			}
			var list v1alpha1.AgentVMList
			if err := r.List(ctx, &list, client.MatchingFields{indexNode: node}); err != nil {
				continue
			}
			woken[node] = renew
			for i := range list.Items {
				select {
				case out <- event.GenericEvent{Object: &list.Items[i]}:
				case <-ctx.Done():
					return
				}
			}
		}
	}
}

// leases tracks when each host's Lease was last seen renewed, by this
// controller's clock: a host's own clock, in renewTime, is not trusted to
// agree with it.
type leases struct {
	now  func() time.Time
	mu   sync.Mutex
	seen map[string]leaseSeen
}

type leaseSeen struct {
	renew string
	at    time.Time
}

func newLeases(now func() time.Time) *leases { return &leases{now: now, seen: map[string]leaseSeen{}} }

// observe records l's renewal; it reports whether it is a new one.
func (ls *leases) observe(l *coordinationv1.Lease) bool {
	renew := ""
	if t := l.Spec.RenewTime; t != nil {
		renew = t.UTC().Format(time.RFC3339Nano)
	}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if s, ok := ls.seen[l.Name]; ok && s.renew == renew {
		return false
	}
	ls.seen[l.Name] = leaseSeen{renew: renew, at: ls.now()}
	return true
}

// silentOver lists the hosts seen whose last renewal is older than d.
func (ls *leases) silentOver(d time.Duration) []string {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	var out []string
	for n, s := range ls.seen {
		if ls.now().Sub(s.at) > d {
			out = append(out, n)
		}
	}
	return out
}

// renewal is the last renewal seen of node.
func (ls *leases) renewal(node string) string {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return ls.seen[node].renew
}

// silent is how long node has gone without a renewal this controller
// saw. A host it has not seen at all counts from now: a restarted
// controller gives every host a full timeout.
func (ls *leases) silent(node string) time.Duration {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	s, ok := ls.seen[node]
	if !ok {
		s = leaseSeen{at: ls.now()}
		ls.seen[node] = s
	}
	return ls.now().Sub(s.at)
}

// PodName is the pod of an AgentVM's run.
func PodName(avm string, run int32) string { return avm + "-" + strconv.Itoa(int(run)) }

// TemplateName is an AgentVM's GPU claim template.
func TemplateName(avm string) string { return avm + "-" + v1alpha1.GPUClaim }

func active(p v1alpha1.Phase) bool {
	switch p {
	case v1alpha1.PhaseStopped, v1alpha1.PhaseFailed, v1alpha1.PhaseLost:
		return false
	}
	return true
}

// Reconcile moves one AgentVM on.
func (r *Reconciler) Reconcile(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	var avm v1alpha1.AgentVM
	if err := r.Get(ctx, req.NamespacedName, &avm); apierrors.IsNotFound(err) {
		// Gone, and its pods with it (garbage collection): each is let go
		// of once its host has stopped and deleted its VM.
		orphans, err := r.orphans(ctx, req.NamespacedName)
		for _, p := range orphans {
			r.retire(ctx, p)
		}
		return r.again(len(orphans) > 0), err
	} else if err != nil {
		return reconcile.Result{}, err
	}
	pods, err := r.runPods(ctx, &avm)
	if err != nil {
		return reconcile.Result{}, err
	}
	if avm.DeletionTimestamp != nil {
		// Its pods go with it (garbage collection); each is let go of
		// once its host has stopped and deleted its VM.
		for _, p := range pods {
			r.retire(ctx, p)
		}
		return r.again(len(pods) > 0), nil
	}
	st := avm.Status.DeepCopy()
	st.ObservedGeneration = avm.Generation
	if st.Run == 0 {
		// The run is named, durably, before its pod is made.
		r.newRun(&avm, st)
		return reconcile.Result{}, r.writeStatus(ctx, &avm, st)
	}
	// Earlier runs' pods, and any not the run's, are retired.
	var pod *corev1.Pod
	for _, p := range pods {
		if p.Name == st.Pod && (st.PodUID == "" || p.UID == st.PodUID) {
			pod = p
		} else {
			r.retire(ctx, p)
		}
	}
	if pod != nil && st.PodUID == "" {
		// Made by a controller that died before it recorded the pod.
		want := PodFor(&avm, st)
		if !sameRun(pod, want) {
			r.release(ctx, pod)
			r.newRun(&avm, st)
			return reconcile.Result{}, r.writeStatus(ctx, &avm, st)
		}
		st.PodUID = pod.UID
	}
	if !active(st.Phase) {
		return r.again(len(pods) > 1), r.writeStatus(ctx, &avm, st)
	}
	if avm.Spec.GPUs != nil {
		if err := r.ensureTemplate(ctx, &avm); err != nil {
			return reconcile.Result{}, r.failOn(ctx, &avm, st, err)
		}
	}
	if pod == nil {
		if st.Phase == v1alpha1.PhasePending && st.PodUID == "" {
			if err := r.createPod(ctx, &avm, st); err != nil {
				return reconcile.Result{}, r.failOn(ctx, &avm, st, err)
			}
			return reconcile.Result{}, r.writeStatus(ctx, &avm, st)
		}
		// The run's pod is gone, and its host let go of it: drained,
		// evicted, or deleted.
		r.runEnded(&avm, st, v1alpha1.PhaseStopped, "Evicted", fmt.Sprintf("the run's pod %s was deleted on %s (a drain or an eviction): its VM was stopped there", st.Pod, st.Node))
		return reconcile.Result{}, r.writeStatus(ctx, &avm, st)
	}
	mirror(pod, st)
	if pod.DeletionTimestamp != nil {
		r.retire(ctx, pod)
	}
	lostWhy := ""
	switch {
	case st.Phase == v1alpha1.PhaseFailed && hostFenced(pod):
		lostWhy = "the host fenced the run: it had not been heard in time"
	case st.Node != "" && active(st.Phase):
		if silent := r.silent(ctx, st.Node); silent > r.cfg.NodeLossTimeout {
			lostWhy = fmt.Sprintf("host %s unheard for %s (over %s)", st.Node, silent.Round(time.Second), r.cfg.NodeLossTimeout)
		}
	}
	if lostWhy != "" {
		// On record first: a controller that dies next still knows the
		// host is lost, and keeps the next run off it.
		lost := st.Node
		if !slices.Contains(st.LostNodes, lost) {
			st.LostNodes = append(st.LostNodes, lost)
		}
		r.runEnded(&avm, st, v1alpha1.PhaseLost, "NodeLost", lostWhy)
		if err := r.writeStatus(ctx, &avm, st); err != nil {
			return reconcile.Result{}, err
		}
		r.release(ctx, pod)
		return reconcile.Result{Requeue: true}, nil
	}
	if err := r.writeStatus(ctx, &avm, st); err != nil {
		return reconcile.Result{}, err
	}
	return reconcile.Result{}, nil
}

// again asks for another look soon, when pods are still on their way out.
func (r *Reconciler) again(waiting bool) reconcile.Result {
	if waiting {
		return reconcile.Result{RequeueAfter: 2 * time.Second}
	}
	return reconcile.Result{}
}

// failOn fails the AgentVM for an error the API server calls invalid
// (a GPU selector that does not compile, say), and returns others.
func (r *Reconciler) failOn(ctx context.Context, avm *v1alpha1.AgentVM, st *v1alpha1.AgentVMStatus, err error) error {
	if !apierrors.IsInvalid(err) && !apierrors.IsForbidden(err) {
		return err
	}
	st.Phase, st.Message = v1alpha1.PhaseFailed, err.Error()
	meta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: "Ready", Status: metav1.ConditionFalse, Reason: "Invalid",
		Message: truncate(err.Error(), 1024), ObservedGeneration: avm.Generation})
	return r.writeStatus(ctx, avm, st)
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// runPods are the pods of the AgentVM's runs, current and earlier.
func (r *Reconciler) runPods(ctx context.Context, avm *v1alpha1.AgentVM) ([]*corev1.Pod, error) {
	var list corev1.PodList
	if err := r.List(ctx, &list, client.InNamespace(avm.Namespace), client.MatchingFields{indexOwner: avm.Name}); err != nil {
		return nil, err
	}
	var out []*corev1.Pod
	for i := range list.Items {
		if p := &list.Items[i]; metav1.IsControlledBy(p, avm) {
			out = append(out, p)
		}
	}
	return out, nil
}

// orphans are the run pods of an AgentVM that is gone.
func (r *Reconciler) orphans(ctx context.Context, avm types.NamespacedName) ([]*corev1.Pod, error) {
	var list corev1.PodList
	if err := r.List(ctx, &list, client.InNamespace(avm.Namespace), client.MatchingFields{indexOwner: avm.Name}); err != nil {
		return nil, err
	}
	out := make([]*corev1.Pod, 0, len(list.Items))
	for i := range list.Items {
		out = append(out, &list.Items[i])
	}
	return out, nil
}

// retire deletes a pod that is no longer its AgentVM's current run, and
// lets go of it (its finalizer) once its host is done with its VM: the
// host reported it gone, or the host is lost, or it never had one.
func (r *Reconciler) retire(ctx context.Context, p *corev1.Pod) {
	if p.DeletionTimestamp == nil {
		if err := r.Delete(ctx, p, client.Preconditions{UID: &p.UID}); err != nil && !apierrors.IsNotFound(err) {
			log.FromContext(ctx).Error(err, "earlier run's pod not deleted", "pod", p.Name)
		}
		return
	}
	if !slices.Contains(p.Finalizers, v1alpha1.RunFinalizer) {
		return
	}
	rep := report(p)
	switch {
	case p.Spec.NodeName == "", rep != nil && rep.Phase == "Gone", r.silent(ctx, p.Spec.NodeName) > r.cfg.NodeLossTimeout:
		r.release(ctx, p)
	default:
		var n corev1.Node
		if err := r.reader.Get(ctx, types.NamespacedName{Name: p.Spec.NodeName}, &n); apierrors.IsNotFound(err) {
			r.release(ctx, p)
		}
	}
}

// release lets go of a pod: its finalizer goes, and it is deleted at once.
func (r *Reconciler) release(ctx context.Context, p *corev1.Pod) {
	if slices.Contains(p.Finalizers, v1alpha1.RunFinalizer) {
		q := p.DeepCopy()
		q.Finalizers = slices.DeleteFunc(q.Finalizers, func(f string) bool { return f == v1alpha1.RunFinalizer })
		if err := r.Patch(ctx, q, client.MergeFromWithOptions(p, client.MergeFromWithOptimisticLock{})); err != nil && !apierrors.IsNotFound(err) {
			log.FromContext(ctx).Error(err, "run pod's finalizer not removed", "pod", p.Name)
			return
		}
	}
	if err := r.Delete(ctx, p, client.GracePeriodSeconds(0), client.Preconditions{UID: &p.UID}); err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		log.FromContext(ctx).Error(err, "run pod not deleted", "pod", p.Name)
	}
}

// silent is how long node's Lease has gone unrenewed; past the timeout
// by the cache, it is read again from the API server before it counts.
func (r *Reconciler) silent(ctx context.Context, node string) time.Duration {
	d := r.leases.silent(node)
	if d <= r.cfg.NodeLossTimeout || r.reader == nil {
		return d
	}
	var l coordinationv1.Lease
	if err := r.reader.Get(ctx, types.NamespacedName{Namespace: "kube-node-lease", Name: node}, &l); err == nil {
		r.leases.observe(&l)
	}
	return r.leases.silent(node)
}

func (r *Reconciler) newRun(avm *v1alpha1.AgentVM, st *v1alpha1.AgentVMStatus) {
	st.Run++
	st.Pod = PodName(avm.Name, st.Run)
	st.Phase, st.Node, st.Session, st.GPUs, st.Message, st.PodUID = v1alpha1.PhasePending, "", "", nil, "", ""
	meta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: "Ready", Status: metav1.ConditionFalse, Reason: "NewRun",
		Message: "run " + strconv.Itoa(int(st.Run)) + " waits for a host", ObservedGeneration: avm.Generation})
}

// runEnded ends the current run: a new one follows under Recreate,
// otherwise the AgentVM takes phase.
func (r *Reconciler) runEnded(avm *v1alpha1.AgentVM, st *v1alpha1.AgentVMStatus, phase v1alpha1.Phase, reason, msg string) {
	r.events.Eventf(avm, nil, corev1.EventTypeWarning, reason, "RunEnded", "%s", msg)
	if avm.Spec.OnNodeLoss == v1alpha1.NodeLossRecreate {
		r.newRun(avm, st)
		st.Message = msg + "; a new run was started"
		return
	}
	st.Phase, st.Message = phase, msg
	meta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: "Ready", Status: metav1.ConditionFalse, Reason: reason,
		Message: msg, ObservedGeneration: avm.Generation})
}

func hostFenced(p *corev1.Pod) bool {
	rep := report(p)
	return rep != nil && rep.Reason == "Fenced"
}

// report is the host's report in the pod, if it has one that parses.
func report(p *corev1.Pod) *v1alpha1.HostReport {
	for _, c := range p.Status.Conditions {
		if c.Type != v1alpha1.ConditionVM || len(c.Message) > v1alpha1.MaxHostReport {
			continue
		}
		var rep v1alpha1.HostReport
		if json.Unmarshal([]byte(c.Message), &rep) == nil {
			return &rep
		}
	}
	return nil
}

// mirror sets the run's status from its pod and its host's report.
func mirror(p *corev1.Pod, st *v1alpha1.AgentVMStatus) {
	st.Node = p.Spec.NodeName
	rep := report(p)
	switch {
	case st.Node == "":
		st.Phase, st.Message = v1alpha1.PhasePending, ""
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse {
				st.Message = c.Message
			}
		}
	case rep == nil:
		st.Phase = v1alpha1.PhaseScheduled
	default:
		st.Session, st.GPUs, st.Message = rep.Session, rep.GPUs, rep.Message
		if rep.Audit != nil {
			st.AuditCheckpoint = rep.Audit
		}
		switch rep.Phase {
		case "Booting":
			st.Phase = v1alpha1.PhaseBooting
		case "Running":
			st.Phase = v1alpha1.PhaseRunning
		case "Stopping", "Gone":
			st.Phase = v1alpha1.PhaseStopping
		case "Stopped":
			st.Phase = v1alpha1.PhaseStopped
		case "Failed":
			st.Phase = v1alpha1.PhaseFailed
			if st.Message == "" {
				st.Message = rep.Reason
			}
		}
	}
	if p.DeletionTimestamp != nil && active(st.Phase) {
		st.Phase = v1alpha1.PhaseStopping
	}
	ready := metav1.Condition{Type: "Ready", Status: metav1.ConditionFalse, Reason: string(st.Phase), Message: st.Message}
	if st.Phase == v1alpha1.PhaseRunning {
		ready.Status, ready.Message = metav1.ConditionTrue, "the VM runs on "+st.Node
	}
	if ready.Reason == "" {
		ready.Reason = "Unknown"
	}
	meta.SetStatusCondition(&st.Conditions, ready)
}

func (r *Reconciler) writeStatus(ctx context.Context, avm *v1alpha1.AgentVM, st *v1alpha1.AgentVMStatus) error {
	if equality.Semantic.DeepEqual(&avm.Status, st) {
		return nil
	}
	avm.Status = *st
	return r.Status().Update(ctx, avm)
}

// ensureTemplate makes the AgentVM's GPU claim template, from which each
// run's pod gets a claim of its own.
func (r *Reconciler) ensureTemplate(ctx context.Context, avm *v1alpha1.AgentVM) error {
	g := avm.Spec.GPUs
	class := g.DeviceClassName
	if class == "" {
		class = v1alpha1.GPUDriver
	}
	var sel []resourcev1.DeviceSelector
	for _, s := range g.Selectors {
		sel = append(sel, resourcev1.DeviceSelector{CEL: &resourcev1.CELDeviceSelector{Expression: s}})
	}
	t := &resourcev1.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: TemplateName(avm.Name), Namespace: avm.Namespace},
		Spec: resourcev1.ResourceClaimTemplateSpec{Spec: resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{
			Requests: []resourcev1.DeviceRequest{{Name: v1alpha1.GPUClaim, Exactly: &resourcev1.ExactDeviceRequest{
				DeviceClassName: class, Selectors: sel, AllocationMode: resourcev1.DeviceAllocationModeExactCount, Count: int64(g.Count)}}},
		}}},
	}
	if err := controllerutil.SetControllerReference(avm, t, r.Scheme()); err != nil {
		return err
	}
	err := r.Create(ctx, t)
	if !apierrors.IsAlreadyExists(err) {
		return err
	}
	var have resourcev1.ResourceClaimTemplate
	if err := r.reader.Get(ctx, client.ObjectKeyFromObject(t), &have); err != nil {
		return err
	}
	if !metav1.IsControlledBy(&have, avm) || !equality.Semantic.DeepEqual(have.Spec, t.Spec) {
		return apierrors.NewForbidden(resourcev1.Resource("resourceclaimtemplates"), t.Name,
			fmt.Errorf("a claim template of that name is not this AgentVM's: delete it"))
	}
	return nil
}

// createPod makes the current run's pod and records its UID. A pod of
// the name made already is the run's only if it is the pod the
// controller would make (a controller killed after making it left it):
// otherwise it is deleted, and the next run named.
func (r *Reconciler) createPod(ctx context.Context, avm *v1alpha1.AgentVM, st *v1alpha1.AgentVMStatus) error {
	want := PodFor(avm, st)
	if err := controllerutil.SetControllerReference(avm, want, r.Scheme()); err != nil {
		return err
	}
	err := r.Create(ctx, want)
	if err == nil {
		st.PodUID = want.UID
		return nil
	}
	if !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create pod %s: %w", want.Name, err)
	}
	var have corev1.Pod
	if err := r.reader.Get(ctx, client.ObjectKeyFromObject(want), &have); err != nil {
		return err
	}
	if sameRun(&have, want) && metav1.IsControlledBy(&have, avm) {
		st.PodUID = have.UID
		return nil
	}
	log.FromContext(ctx).Info("a pod of the run's name is not the run's: deleting it, and naming the next run", "pod", have.Name)
	r.release(ctx, &have)
	r.newRun(avm, st)
	return nil
}

// sameRun reports whether have is the pod want describes, placed by the
// scheduler if at all.
func sameRun(have, want *corev1.Pod) bool {
	if have.Spec.NodeName != "" {
		scheduled := false
		for _, c := range have.Status.Conditions {
			scheduled = scheduled || c.Type == corev1.PodScheduled && c.Status == corev1.ConditionTrue
		}
		if !scheduled {
			return false
		}
	}
	if len(have.Spec.Containers) != 1 || have.Spec.Containers[0].Image != want.Spec.Containers[0].Image ||
		!equality.Semantic.DeepEqual(have.Spec.Containers[0].Resources, want.Spec.Containers[0].Resources) {
		return false
	}
	return equality.Semantic.DeepEqual(have.Spec.NodeSelector, want.Spec.NodeSelector) &&
		equality.Semantic.DeepEqual(have.Spec.Tolerations, want.Spec.Tolerations) &&
		equality.Semantic.DeepEqual(have.Spec.Affinity, want.Spec.Affinity) &&
		equality.Semantic.DeepEqual(have.Spec.ResourceClaims, want.Spec.ResourceClaims) &&
		slices.Contains(have.Finalizers, v1alpha1.RunFinalizer)
}

// PodFor is the pod of the AgentVM's current run.
func PodFor(avm *v1alpha1.AgentVM, st *v1alpha1.AgentVMStatus) *corev1.Pod {
	mem := int64(1 << 30)
	if avm.Spec.Memory != nil {
		mem = avm.Spec.Memory.Value()
	}
	res := corev1.ResourceList{
		corev1.ResourceCPU:    *resource.NewQuantity(int64(max(avm.Spec.CPUs, 1)), resource.DecimalSI),
		corev1.ResourceMemory: *resource.NewQuantity(mem+PodMemoryOverhead, resource.BinarySI),
	}
	c := corev1.Container{Name: "vm", Image: v1alpha1.PodImage,
		Resources: corev1.ResourceRequirements{Requests: res, Limits: res.DeepCopy()}}
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: st.Pod, Namespace: avm.Namespace,
			Labels: map[string]string{v1alpha1.LabelAgentVM: avm.Name},
			// Held until its host has stopped and deleted the VM, so the
			// next run starts only after this one has ended there.
			Finalizers: []string{v1alpha1.RunFinalizer}},
		Spec: corev1.PodSpec{
			// Hosts an administrator admitted: a node cannot set this
			// label on itself.
			NodeSelector: map[string]string{v1alpha1.LabelAdmitted: "true"},
			Tolerations: []corev1.Toleration{
				{Key: v1alpha1.TaintHost, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule},
				// No time limit: evicting a run destroys its VM. A
				// silent host is the controller's to declare lost.
				{Key: corev1.TaintNodeUnreachable, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute},
				{Key: corev1.TaintNodeNotReady, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute},
			},
			RestartPolicy:                 corev1.RestartPolicyNever,
			TerminationGracePeriodSeconds: ptr.To(int64(podGracePeriod)),
			AutomountServiceAccountToken:  ptr.To(false),
			EnableServiceLinks:            ptr.To(false),
		},
	}
	if avm.Spec.Driver != "" {
		p.Spec.NodeSelector[v1alpha1.LabelDriver] = avm.Spec.Driver
	}
	if avm.Spec.GPUs != nil {
		p.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: v1alpha1.GPUClaim, ResourceClaimTemplateName: ptr.To(TemplateName(avm.Name))}}
		c.Resources.Claims = []corev1.ResourceClaim{{Name: v1alpha1.GPUClaim}}
	}
	if len(st.LostNodes) > 0 {
		// By the hostname label, which hosts set to their Node's name: a
		// field selector on metadata.name takes one value only, and runs
		// may be lost on several hosts (a rack).
		p.Spec.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
			NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{{
				Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpNotIn, Values: st.LostNodes}}}}}}}
	}
	p.Spec.Containers = []corev1.Container{c}
	return p
}
