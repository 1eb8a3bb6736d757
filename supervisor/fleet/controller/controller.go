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
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/carrel-os/carrel/supervisor/fleet/v1alpha1"
)

// Defaults.
const (
	DefaultNodeLossTimeout = 60 * time.Second
	// PodMemoryOverhead is added to a run's memory request: QEMU's own.
	PodMemoryOverhead = 256 << 20
	// podGracePeriod bounds a host's graceful stop of a run's VM.
	podGracePeriod = 60
	// indexNode indexes AgentVMs by status.node.
	indexNode = "status.node"
)

// Config configures the controller.
type Config struct {
	// NodeLossTimeout is how long a host's Lease may go unrenewed before
	// its runs are Lost. Hosts fence themselves well before it.
	NodeLossTimeout time.Duration
	// now is the clock; tests replace it.
	now func() time.Time
}

// Reconciler reconciles AgentVMs.
type Reconciler struct {
	client.Client
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
	r := &Reconciler{Client: mgr.GetClient(), cfg: cfg, leases: newLeases(cfg.now),
		events: mgr.GetEventRecorder("carrel-controller")}
	if err := mgr.GetFieldIndexer().IndexField(context.Background(), &v1alpha1.AgentVM{}, indexNode, func(o client.Object) []string {
		if n := o.(*v1alpha1.AgentVM).Status.Node; n != "" {
			return []string{n}
		}
		return nil
	}); err != nil {
		return err
	}
	return ctrl.NewControllerManagedBy(mgr).
		Named("agentvm").
		For(&v1alpha1.AgentVM{}).
		Owns(&corev1.Pod{}).
		Watches(&coordinationv1.Lease{}, handler.EnqueueRequestsFromMapFunc(r.leaseChanged)).
		Complete(r)
}

// leaseChanged notes a host's renewal and wakes the AgentVMs placed on it.
func (r *Reconciler) leaseChanged(ctx context.Context, o client.Object) []reconcile.Request {
	l, ok := o.(*coordinationv1.Lease)
	if !ok || l.Namespace != "kube-node-lease" {
		return nil
	}
	if !r.leases.observe(l) {
		return nil
	}
	var list v1alpha1.AgentVMList
	if err := r.List(ctx, &list, client.MatchingFields{indexNode: l.Name}); err != nil {
		return nil
	}
	out := make([]reconcile.Request, 0, len(list.Items))
	for _, a := range list.Items {
		out = append(out, reconcile.Request{NamespacedName: types.NamespacedName{Namespace: a.Namespace, Name: a.Name}})
	}
	return out
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
	if err := r.Get(ctx, req.NamespacedName, &avm); err != nil {
		return reconcile.Result{}, client.IgnoreNotFound(err)
	}
	if avm.DeletionTimestamp != nil {
		return reconcile.Result{}, nil // its pods and template go with it
	}
	st := avm.Status.DeepCopy()
	st.ObservedGeneration = avm.Generation
	if st.Run == 0 {
		// The run is named, durably, before its pod is made.
		r.newRun(&avm, st)
		return reconcile.Result{}, r.writeStatus(ctx, &avm, st)
	}
	if !active(st.Phase) {
		return reconcile.Result{}, r.writeStatus(ctx, &avm, st)
	}
	if avm.Spec.GPUs != nil {
		if err := r.ensureTemplate(ctx, &avm); err != nil {
			return reconcile.Result{}, err
		}
	}
	var pod corev1.Pod
	err := r.Get(ctx, types.NamespacedName{Namespace: avm.Namespace, Name: st.Pod}, &pod)
	switch {
	case apierrors.IsNotFound(err) && st.Phase == v1alpha1.PhasePending:
		if err := r.createPod(ctx, &avm, st); err != nil {
			return reconcile.Result{}, err
		}
		return reconcile.Result{}, r.writeStatus(ctx, &avm, st)
	case apierrors.IsNotFound(err):
		// A placed run's pod went away: drained, evicted, or deleted.
		r.runEnded(&avm, st, v1alpha1.PhaseStopped, "Evicted", fmt.Sprintf("the run's pod %s was deleted on %s (a drain or an eviction): its VM was stopped there", st.Pod, st.Node))
		return reconcile.Result{}, r.writeStatus(ctx, &avm, st)
	case err != nil:
		return reconcile.Result{}, err
	}
	if !metav1.IsControlledBy(&pod, &avm) {
		st.Phase, st.Message = v1alpha1.PhaseFailed, fmt.Sprintf("pod %s is not this AgentVM's", pod.Name)
		return reconcile.Result{}, r.writeStatus(ctx, &avm, st)
	}
	mirror(&pod, st)
	switch {
	case st.Phase == v1alpha1.PhaseFailed && hostFenced(&pod):
		r.lose(ctx, &avm, st, &pod, "the host fenced the run: it had not been heard in time")
	case st.Node != "" && active(st.Phase):
		if silent := r.leases.silent(st.Node); silent > r.cfg.NodeLossTimeout {
			r.lose(ctx, &avm, st, &pod, fmt.Sprintf("host %s unheard for %s (over %s)", st.Node, silent.Round(time.Second), r.cfg.NodeLossTimeout))
		}
	}
	if err := r.writeStatus(ctx, &avm, st); err != nil {
		return reconcile.Result{}, err
	}
	if active(st.Phase) && st.Node != "" {
		return reconcile.Result{RequeueAfter: r.cfg.NodeLossTimeout / 4}, nil
	}
	return reconcile.Result{}, nil
}

func (r *Reconciler) newRun(avm *v1alpha1.AgentVM, st *v1alpha1.AgentVMStatus) {
	st.Run++
	st.Pod = PodName(avm.Name, st.Run)
	st.Phase, st.Node, st.Session, st.GPUs, st.Message = v1alpha1.PhasePending, "", "", nil, ""
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

// lose declares the run's host lost: its pod is deleted at once (the
// host fenced the VM already), which frees the run's GPUs.
func (r *Reconciler) lose(ctx context.Context, avm *v1alpha1.AgentVM, st *v1alpha1.AgentVMStatus, pod *corev1.Pod, why string) {
	lost := st.Node
	if err := r.Delete(ctx, pod, client.GracePeriodSeconds(0), client.Preconditions{UID: &pod.UID}); err != nil && !apierrors.IsNotFound(err) {
		log.FromContext(ctx).Error(err, "lost run's pod not deleted", "pod", pod.Name)
	}
	if lost != "" && !slices.Contains(st.LostNodes, lost) {
		st.LostNodes = append(st.LostNodes, lost)
	}
	r.runEnded(avm, st, v1alpha1.PhaseLost, "NodeLost", why)
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
	if err := r.Create(ctx, t); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create claim template: %w", err)
	}
	return nil
}

// createPod makes the current run's pod; one made already is kept.
func (r *Reconciler) createPod(ctx context.Context, avm *v1alpha1.AgentVM, st *v1alpha1.AgentVMStatus) error {
	p := PodFor(avm, st)
	if err := controllerutil.SetControllerReference(avm, p, r.Scheme()); err != nil {
		return err
	}
	if err := r.Create(ctx, p); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create pod %s: %w", p.Name, err)
	}
	return nil
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
			Labels: map[string]string{v1alpha1.LabelAgentVM: avm.Name}},
		Spec: corev1.PodSpec{
			NodeSelector: map[string]string{v1alpha1.LabelHost: "true"},
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
		p.Spec.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
			NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchFields: []corev1.NodeSelectorRequirement{{
				Key: "metadata.name", Operator: corev1.NodeSelectorOpNotIn, Values: st.LostNodes}}}}}}}
	}
	p.Spec.Containers = []corev1.Container{c}
	return p
}
