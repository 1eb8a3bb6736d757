// Package kube makes carreld a Kubernetes node for its own VMs, with no
// kubelet: it registers its Node and renews the Node's Lease, publishes
// its assignable GPUs as a ResourceSlice, turns each AgentVM run's pod
// bound to it into a run of supervisor/node, and reports the run in the
// pod's status, which the controller mirrors into the AgentVM.
//
// It acts as the Node's own identity (system:node:<name>), which the API
// server's Node authorizer and NodeRestriction admission hold to this
// Node, its Lease, its slice and the pods bound to it. A pod is run only
// if its AgentVM (read by UID) names it as its current run: a pod that
// anyone else made, bound here by hand, runs nothing.
package kube

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	goruntime "runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"

	"github.com/carrel-os/carrel/supervisor/fence"
	"github.com/carrel-os/carrel/supervisor/fleet/v1alpha1"
	"github.com/carrel-os/carrel/supervisor/gpu"
	"github.com/carrel-os/carrel/supervisor/node"
)

// LeaseNamespace holds the Nodes' Leases.
const LeaseNamespace = "kube-node-lease"

// Config configures a Node.
type Config struct {
	REST *rest.Config
	// Name is the Node's name (carrel-<hostname> by default).
	Name  string
	Agent *node.Agent
	// Alive checks carreld answers: the Lease is renewed only then, so
	// that a frozen carreld loses it.
	Alive func(ctx context.Context) error
	// Heard is told of each renewal, with when it began by the wall
	// clock and by CLOCK_BOOTTIME (fence.Boottime).
	Heard func(start time.Time, boot int64)
	// GPUs lists the host's GPUs; the assignable ones are published.
	GPUs func() (gpu.Inventory, error)
	// Driver is carreld's driver for new VMs, put on the Node's labels.
	Driver string
	// CPUs and Memory are what the Node offers VMs; Pods caps its runs.
	CPUs   int64
	Memory int64
	Pods   int64
	// Version is carreld's, put on the Node.
	Version string
	// ApplyPolicy applies a Policy's bundle on the host under name, as
	// carrel policy apply does.
	ApplyPolicy func(ctx context.Context, name string, files map[string][]byte) error
	// Audit returns the host's latest audit checkpoint, or nil.
	Audit func() *v1alpha1.AuditCheckpoint
	// LeaseDuration is the Lease's declared duration; RenewInterval is
	// how often it is renewed (10 s).
	LeaseDuration time.Duration
	RenewInterval time.Duration
	Log           *slog.Logger
}

// DefaultName is the Node name for this host: carrel-<hostname>.
func DefaultName() string {
	h, err := os.Hostname()
	if err != nil || h == "" {
		h = "localhost"
	}
	h = strings.ToLower(strings.SplitN(h, ".", 2)[0])
	return "carrel-" + h
}

// Node is carreld's Kubernetes node.
type Node struct {
	cfg  Config
	log  *slog.Logger
	cs   kubernetes.Interface
	dyn  dynamic.Interface
	pods cache.Indexer
	kick chan struct{}

	mu       sync.Mutex
	devices  map[string]string         // published device name -> PCI address
	policies map[types.UID]int64       // Policies applied, at their generation
	accepted map[types.UID]acceptedPod // pods checked against their AgentVMs
	reported map[types.UID]string      // the last report written, by pod
}

type acceptedPod struct {
	run node.Run
	err error     // why the pod runs nothing
	at  time.Time // when it was checked
}

var agentVMs = v1alpha1.GroupVersion.WithResource("agentvms")

// New connects to the API server.
func New(cfg Config) (*Node, error) {
	if cfg.Name == "" {
		cfg.Name = DefaultName()
	}
	if cfg.LeaseDuration == 0 {
		cfg.LeaseDuration = 40 * time.Second
	}
	if cfg.RenewInterval == 0 {
		cfg.RenewInterval = 10 * time.Second
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	cs, err := kubernetes.NewForConfig(cfg.REST)
	if err != nil {
		return nil, err
	}
	dyn, err := dynamic.NewForConfig(cfg.REST)
	if err != nil {
		return nil, err
	}
	return &Node{cfg: cfg, log: cfg.Log.With("node", cfg.Name), cs: cs, dyn: dyn,
		kick: make(chan struct{}, 1), devices: map[string]string{}, accepted: map[types.UID]acceptedPod{}, policies: map[types.UID]int64{},
		reported: map[types.UID]string{}}, nil
}

// Run registers the Node and serves until ctx ends.
func (n *Node) Run(ctx context.Context) error {
	if err := n.register(ctx); err != nil {
		return fmt.Errorf("register node %s: %w", n.cfg.Name, err)
	}
	if err := n.renew(ctx); err != nil {
		return fmt.Errorf("node %s lease: %w", n.cfg.Name, err)
	}
	if err := n.publish(ctx); err != nil {
		n.log.Error("GPUs not published", "err", err)
	}
	f := informers.NewSharedInformerFactoryWithOptions(n.cs, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", n.cfg.Name).String()
	}))
	inf := f.Core().V1().Pods().Informer()
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { n.poke() },
		UpdateFunc: func(any, any) { n.poke() },
		DeleteFunc: func(any) { n.poke() },
	}); err != nil {
		return err
	}
	n.pods = inf.GetIndexer()
	f.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		return ctx.Err()
	}
	n.log.Info("fleet node registered", "lease", n.cfg.LeaseDuration, "renew", n.cfg.RenewInterval)
	go n.every(ctx, n.cfg.RenewInterval, func() {
		if err := n.renew(ctx); err != nil {
			n.log.Warn("lease not renewed", "err", err)
		}
	})
	go n.every(ctx, 30*time.Second, func() {
		if err := n.publish(ctx); err != nil {
			n.log.Warn("GPUs not published", "err", err)
		}
	})
	go n.every(ctx, time.Minute, func() {
		if err := n.heartbeat(ctx); err != nil {
			n.log.Warn("node status not updated", "err", err)
		}
	})
	t := time.NewTicker(2 * time.Second)
	defer t.Stop()
	for {
		// carreld's calls get a deadline: a frozen carreld must not
		// hold the sync up for good.
		sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err := n.sync(sctx)
		cancel()
		if err != nil && ctx.Err() == nil {
			n.log.Warn("fleet sync", "err", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-n.kick:
		case <-t.C:
		}
	}
}

// Changed asks for a sync soon: a run's status changed.
func (n *Node) Changed() { n.poke() }

func (n *Node) poke() {
	select {
	case n.kick <- struct{}{}:
	default:
	}
}

func (n *Node) every(ctx context.Context, d time.Duration, fn func()) {
	t := time.NewTicker(d)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			fn()
		}
	}
}

// register creates the Node, or brings its labels, taint and status up
// to date; a cordon (spec.unschedulable) is left as it is.
func (n *Node) register(ctx context.Context) error {
	return retry.RetryOnConflict(retry.DefaultBackoff, func() error { return n.registerOnce(ctx) })
}

func (n *Node) registerOnce(ctx context.Context) error {
	nodes := n.cs.CoreV1().Nodes()
	want := n.nodeObject()
	cur, err := nodes.Get(ctx, n.cfg.Name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		cur, err = nodes.Create(ctx, want, metav1.CreateOptions{})
		if err != nil {
			return err
		}
	case err != nil:
		return err
	default:
		if cur.Labels == nil {
			cur.Labels = map[string]string{}
		}
		maps.Copy(cur.Labels, want.Labels)
		if !slices.ContainsFunc(cur.Spec.Taints, func(t corev1.Taint) bool { return t.Key == v1alpha1.TaintHost }) {
			cur.Spec.Taints = append(cur.Spec.Taints, want.Spec.Taints...)
		}
		if cur, err = nodes.Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
			return err
		}
	}
	return n.writeStatus(ctx, cur)
}

func (n *Node) nodeObject() *corev1.Node {
	return &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: n.cfg.Name, Labels: map[string]string{
			v1alpha1.LabelHost:       "true",
			v1alpha1.LabelDriver:     n.cfg.Driver,
			"kubernetes.io/hostname": n.cfg.Name,
			"kubernetes.io/os":       "linux",
			"kubernetes.io/arch":     "amd64",
			"type":                   "carrel",
		}},
		Spec: corev1.NodeSpec{Taints: []corev1.Taint{{Key: v1alpha1.TaintHost, Value: "true", Effect: corev1.TaintEffectNoSchedule}}},
	}
}

// writeStatus sets the Node's capacity and its Ready condition.
func (n *Node) writeStatus(ctx context.Context, cur *corev1.Node) error {
	now := metav1.Now()
	res := corev1.ResourceList{
		corev1.ResourceCPU:    *resource.NewQuantity(n.cfg.CPUs, resource.DecimalSI),
		corev1.ResourceMemory: *resource.NewQuantity(n.cfg.Memory, resource.BinarySI),
		corev1.ResourcePods:   *resource.NewQuantity(n.cfg.Pods, resource.DecimalSI),
	}
	cur.Status.Capacity, cur.Status.Allocatable = res, res.DeepCopy()
	ready := corev1.NodeCondition{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "CarreldReady",
		Message: "carreld is serving its VMs", LastHeartbeatTime: now, LastTransitionTime: now}
	found := false
	for i, c := range cur.Status.Conditions {
		if c.Type == corev1.NodeReady {
			if c.Status == corev1.ConditionTrue {
				ready.LastTransitionTime = c.LastTransitionTime
			}
			cur.Status.Conditions[i], found = ready, true
		}
	}
	if !found {
		cur.Status.Conditions = append(cur.Status.Conditions, ready)
	}
	// Where carrel --host reaches this carreld (over ssh).
	if h, err := os.Hostname(); err == nil && h != "" {
		cur.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeHostName, Address: h}}
	}
	cur.Status.NodeInfo.KubeletVersion = "carreld/" + n.cfg.Version
	cur.Status.NodeInfo.OperatingSystem, cur.Status.NodeInfo.Architecture = "linux", "amd64"
	_, err := n.cs.CoreV1().Nodes().UpdateStatus(ctx, cur, metav1.UpdateOptions{})
	return err
}

func (n *Node) heartbeat(ctx context.Context) error {
	return retry.RetryOnConflict(retry.DefaultBackoff, func() error {
		cur, err := n.cs.CoreV1().Nodes().Get(ctx, n.cfg.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		return n.writeStatus(ctx, cur)
	})
}

// renew renews the Node's Lease, creating it the first time. The agent
// hears of each success with the time the attempt began: the API server
// saw the renewal after that.
func (n *Node) renew(ctx context.Context) error {
	start, boot := time.Now(), fence.Boottime()
	ctx, cancel := context.WithTimeout(ctx, n.cfg.RenewInterval)
	defer cancel()
	if n.cfg.Alive != nil {
		if err := n.cfg.Alive(ctx); err != nil {
			return fmt.Errorf("carreld does not answer, so the lease is left to lapse: %w", err)
		}
	}
	leases := n.cs.CoordinationV1().Leases(LeaseNamespace)
	now := metav1.NewMicroTime(time.Now())
	l, err := leases.Get(ctx, n.cfg.Name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		nd, err := n.cs.CoreV1().Nodes().Get(ctx, n.cfg.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		l = &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Name: n.cfg.Name, Namespace: LeaseNamespace, OwnerReferences: []metav1.OwnerReference{{
				APIVersion: "v1", Kind: "Node", Name: nd.Name, UID: nd.UID}}},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To(n.cfg.Name),
				LeaseDurationSeconds: ptr.To(int32(n.cfg.LeaseDuration / time.Second)), RenewTime: &now},
		}
		_, err = leases.Create(ctx, l, metav1.CreateOptions{})
		if err != nil {
			return err
		}
	case err != nil:
		return err
	default:
		l.Spec.RenewTime = &now
		l.Spec.HolderIdentity = ptr.To(n.cfg.Name)
		l.Spec.LeaseDurationSeconds = ptr.To(int32(n.cfg.LeaseDuration / time.Second))
		if _, err := leases.Update(ctx, l, metav1.UpdateOptions{}); err != nil {
			return err
		}
	}
	n.cfg.Agent.Heard(start)
	if n.cfg.Heard != nil {
		n.cfg.Heard(start, boot)
	}
	return nil
}

// deviceName is a GPU's device name in the slice: a DNS label.
func deviceName(addr string) string {
	return "gpu-" + strings.NewReplacer(":", "-", ".", "-").Replace(addr)
}

// publish writes the host's assignable GPUs as its ResourceSlice.
func (n *Node) publish(ctx context.Context) error {
	if n.cfg.GPUs == nil {
		return nil
	}
	inv, err := n.cfg.GPUs()
	if err != nil {
		return err
	}
	var devs []resourcev1.Device
	names := map[string]string{}
	for _, g := range inv.GPUs {
		if !g.Assignable {
			continue
		}
		addr := g.Address.String()
		name := deviceName(addr)
		names[name] = addr
		attrs := map[resourcev1.QualifiedName]resourcev1.DeviceAttribute{
			"pciAddress": {StringValue: ptr.To(addr)},
			"iommuGroup": {IntValue: ptr.To(int64(g.IOMMUGroup))},
			"vendorID":   {StringValue: ptr.To(fmt.Sprintf("%04x", g.VendorID))},
			"deviceID":   {StringValue: ptr.To(fmt.Sprintf("%04x", g.DeviceID))},
			"numaNode":   {IntValue: ptr.To(int64(g.NUMANode))},
			// The Kubernetes-wide name of a device's PCI address.
			"resource.kubernetes.io/pciBusID": {StringValue: ptr.To(addr)},
		}
		if g.Name != "" {
			attrs["model"] = resourcev1.DeviceAttribute{StringValue: ptr.To(truncate(g.Name, 64))}
		}
		devs = append(devs, resourcev1.Device{Name: name, Attributes: attrs})
	}
	n.mu.Lock()
	n.devices = names
	n.mu.Unlock()
	// A node may read only the slices of its own (by this field
	// selector), and write only those.
	api := n.cs.ResourceV1().ResourceSlices()
	list, err := api.List(ctx, metav1.ListOptions{FieldSelector: fields.AndSelectors(
		fields.OneTermEqualSelector("spec.nodeName", n.cfg.Name),
		fields.OneTermEqualSelector("spec.driver", v1alpha1.GPUDriver)).String()})
	if err != nil {
		return err
	}
	name := n.cfg.Name + "-" + v1alpha1.GPUDriver
	var cur *resourcev1.ResourceSlice
	for i := range list.Items {
		if list.Items[i].Name == name {
			cur = &list.Items[i]
		}
	}
	if cur == nil {
		if len(devs) == 0 {
			return nil
		}
		s := &resourcev1.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: resourcev1.ResourceSliceSpec{
			Driver: v1alpha1.GPUDriver, NodeName: ptr.To(n.cfg.Name), Devices: devs,
			Pool: resourcev1.ResourcePool{Name: n.cfg.Name, Generation: 1, ResourceSliceCount: 1}}}
		_, err = api.Create(ctx, s, metav1.CreateOptions{})
		return err
	}
	if equalDevices(cur.Spec.Devices, devs) {
		return nil
	}
	cur.Spec.Devices = devs
	cur.Spec.Pool.Generation++
	_, err = api.Update(ctx, cur, metav1.UpdateOptions{})
	return err
}

func equalDevices(a, b []resourcev1.Device) bool {
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	return string(ja) == string(jb)
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// sync hands the agent the runs of the pods bound here, and reports
// each run in its pod's status.
func (n *Node) sync(ctx context.Context) error {
	var want []node.Run
	var keep []string                // runs of pods that could not be checked just now
	pods := map[string]*corev1.Pod{} // by run id
	var deleting []*corev1.Pod
	present := map[types.UID]bool{}
	for _, o := range n.pods.List() {
		p, ok := o.(*corev1.Pod)
		if !ok || p.Labels[v1alpha1.LabelAgentVM] == "" {
			continue
		}
		present[p.UID] = true
		if p.DeletionTimestamp != nil {
			deleting = append(deleting, p)
			continue
		}
		acc := n.accept(ctx, p)
		switch {
		case acc.err != nil && isTransient(acc.err):
			// Neither refused nor run: asked again at the next sync, and
			// a VM it has is left as it is.
			keep = append(keep, string(p.UID))
			continue
		case acc.err != nil:
			n.report(ctx, p, v1alpha1.HostReport{Phase: string(node.Failed), Reason: "Refused", Message: acc.err.Error()})
			continue
		}
		r := acc.run
		r.Ended = p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed
		want = append(want, r)
		pods[r.ID] = p
	}
	n.mu.Lock()
	for uid := range n.accepted {
		if !present[uid] {
			delete(n.accepted, uid)
			delete(n.reported, uid)
		}
	}
	n.mu.Unlock()
	if err := n.cfg.Agent.Sync(ctx, want, keep); err != nil {
		return err
	}
	st, err := n.cfg.Agent.Statuses(ctx)
	if err != nil {
		return err
	}
	var audit *v1alpha1.AuditCheckpoint
	if n.cfg.Audit != nil {
		audit = n.cfg.Audit()
	}
	for id, p := range pods {
		s, ok := st[id]
		if !ok {
			continue
		}
		n.report(ctx, p, v1alpha1.HostReport{Phase: string(s.Phase), Session: s.Session, GPUs: s.GPUs,
			Reason: s.Reason, Message: s.Message, Audit: audit})
	}
	// A pod being deleted is let go once its run's VM is gone: reported
	// Gone (the controller then lifts its finalizer) and deleted.
	for _, p := range deleting {
		id := string(p.UID)
		if s, ok := st[id]; ok && s.Phase != node.Gone {
			n.report(ctx, p, v1alpha1.HostReport{Phase: string(s.Phase), Session: s.Session, GPUs: s.GPUs, Reason: s.Reason, Message: s.Message})
			continue
		}
		n.report(ctx, p, v1alpha1.HostReport{Phase: string(node.Gone), Message: "the run's VM was stopped and deleted"})
		err := n.cs.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{
			GracePeriodSeconds: ptr.To(int64(0)), Preconditions: &metav1.Preconditions{UID: &p.UID}})
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			n.log.Warn("pod not deleted", "pod", p.Namespace+"/"+p.Name, "err", err)
		}
	}
	return nil
}

// recheck is how often an accepted pod is checked against its AgentVM
// again: one the AgentVM no longer names is withdrawn.
const recheck = 30 * time.Second

// accept checks a pod against its AgentVM: the AgentVM must own it and
// name it, by UID, as its current run. The run's GPUs are those its
// claim was allocated from this host's slice. A pod accepted is checked
// again every recheck; one that cannot be checked just now keeps what
// it had.
func (n *Node) accept(ctx context.Context, p *corev1.Pod) acceptedPod {
	n.mu.Lock()
	acc, ok := n.accepted[p.UID]
	n.mu.Unlock()
	if ok && (acc.err != nil || time.Since(acc.at) < recheck) {
		return acc
	}
	run, err := n.runOf(ctx, p)
	switch {
	case err != nil && isTransient(err) && ok:
		return acc
	case err != nil && isTransient(err):
		return acceptedPod{err: err}
	case ok && err == nil:
		run.GPUs = acc.run.GPUs // allocated once, at the start
	}
	acc = acceptedPod{run: run, err: err, at: time.Now()}
	n.mu.Lock()
	n.accepted[p.UID] = acc
	n.mu.Unlock()
	if err != nil {
		n.log.Warn("pod refused", "pod", p.Namespace+"/"+p.Name, "err", err)
	}
	return acc
}

type transient struct{ error }

func isTransient(err error) bool { var t transient; return errors.As(err, &t) }

func (n *Node) runOf(ctx context.Context, p *corev1.Pod) (node.Run, error) {
	var owner *metav1.OwnerReference
	for i, o := range p.OwnerReferences {
		if o.Kind == "AgentVM" && o.APIVersion == v1alpha1.GroupVersion.String() && ptr.Deref(o.Controller, false) {
			owner = &p.OwnerReferences[i]
		}
	}
	if owner == nil {
		return node.Run{}, errors.New("the pod is not an AgentVM's run")
	}
	u, err := n.dyn.Resource(agentVMs).Namespace(p.Namespace).Get(ctx, owner.Name, metav1.GetOptions{})
	if err != nil {
		if apierrors.IsNotFound(err) {
			return node.Run{}, fmt.Errorf("AgentVM %s/%s is gone", p.Namespace, owner.Name)
		}
		return node.Run{}, transient{fmt.Errorf("read AgentVM %s/%s: %w", p.Namespace, owner.Name, err)}
	}
	var avm v1alpha1.AgentVM
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &avm); err != nil {
		return node.Run{}, fmt.Errorf("AgentVM %s/%s: %w", p.Namespace, owner.Name, err)
	}
	switch {
	case avm.UID != owner.UID || avm.Status.Pod != p.Name:
		return node.Run{}, fmt.Errorf("AgentVM %s/%s does not name pod %s as its current run", p.Namespace, owner.Name, p.Name)
	case avm.Status.PodUID == "":
		return node.Run{}, transient{fmt.Errorf("AgentVM %s/%s has not recorded its pod yet", p.Namespace, owner.Name)}
	case avm.Status.PodUID != p.UID:
		return node.Run{}, fmt.Errorf("AgentVM %s/%s names another pod %s as its current run", p.Namespace, owner.Name, p.Name)
	}
	spec, err := SpecOf(&avm)
	if err != nil {
		return node.Run{}, err
	}
	if spec.Policy, err = n.policy(ctx, p.Namespace, avm.Spec.PolicyRef); err != nil {
		return node.Run{}, err
	}
	r := node.Run{ID: string(p.UID), Owner: p.Namespace + "/" + avm.Name, VM: avm.Name, Spec: spec}
	if avm.Spec.GPUs != nil {
		if r.GPUs, err = n.allocated(ctx, p, int(avm.Spec.GPUs.Count)); err != nil {
			return node.Run{}, err
		}
	}
	return r, nil
}

var policies = v1alpha1.GroupVersion.WithResource("policies")

// policy resolves an AgentVM's policyRef: a Policy of its namespace is
// applied on the host (again when it changed) and named as the host
// names it; otherwise the ref names a policy the host has.
func (n *Node) policy(ctx context.Context, namespace, ref string) (string, error) {
	if ref == "" {
		return "", nil
	}
	u, err := n.dyn.Resource(policies).Namespace(namespace).Get(ctx, ref, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return ref, nil
	case err != nil:
		return "", transient{fmt.Errorf("read Policy %s/%s: %w", namespace, ref, err)}
	}
	name := v1alpha1.HostPolicyName(namespace, ref)
	n.mu.Lock()
	applied, ok := n.policies[u.GetUID()]
	n.mu.Unlock()
	if ok && applied == u.GetGeneration() {
		return name, nil
	}
	var pol v1alpha1.Policy
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &pol); err != nil {
		return "", fmt.Errorf("Policy %s/%s: %w", namespace, ref, err)
	}
	files := make(map[string][]byte, len(pol.Spec.Files))
	for f, body := range pol.Spec.Files {
		files[f] = []byte(body)
	}
	if n.cfg.ApplyPolicy == nil {
		return "", errors.New("this host applies no Policies")
	}
	if err := n.cfg.ApplyPolicy(ctx, name, files); err != nil {
		return "", fmt.Errorf("apply Policy %s/%s as %s: %w", namespace, ref, name, err)
	}
	n.log.Info("Policy applied", "policy", namespace+"/"+ref, "as", name, "generation", u.GetGeneration())
	n.mu.Lock()
	n.policies[u.GetUID()] = u.GetGeneration()
	n.mu.Unlock()
	return name, nil
}

// SpecOf is the VM an AgentVM's runs boot.
func SpecOf(avm *v1alpha1.AgentVM) (node.Spec, error) {
	s := node.Spec{Image: avm.Spec.Image, CPUs: uint32(max(avm.Spec.CPUs, 1)), Policy: avm.Spec.PolicyRef}
	if m := avm.Spec.Memory; m != nil {
		if m.Sign() <= 0 {
			return node.Spec{}, fmt.Errorf("memory %s: must be positive", m)
		}
		s.MemoryBytes = uint64(m.Value())
	} else {
		s.MemoryBytes = 1 << 30
	}
	if w := avm.Spec.Workspace; w != nil {
		if w.Sign() <= 0 {
			return node.Spec{}, fmt.Errorf("workspace %s: must be positive", w)
		}
		s.WorkspaceBytes = uint64(w.Value())
	}
	if d := avm.Spec.DeadlineSeconds; d != nil {
		s.Deadline = time.Duration(*d) * time.Second
	}
	return s, nil
}

// allocated returns the PCI addresses of the GPUs the pod's claim was
// allocated: devices of this host's slice, reserved for this pod.
func (n *Node) allocated(ctx context.Context, p *corev1.Pod, count int) ([]string, error) {
	var claim string
	for _, s := range p.Status.ResourceClaimStatuses {
		if s.Name == v1alpha1.GPUClaim && s.ResourceClaimName != nil {
			claim = *s.ResourceClaimName
		}
	}
	if claim == "" {
		return nil, transient{errors.New("the pod's GPU claim is not made yet")}
	}
	c, err := n.cs.ResourceV1().ResourceClaims(p.Namespace).Get(ctx, claim, metav1.GetOptions{})
	if err != nil {
		return nil, transient{fmt.Errorf("read claim %s: %w", claim, err)}
	}
	if c.Status.Allocation == nil || !slices.ContainsFunc(c.Status.ReservedFor, func(r resourcev1.ResourceClaimConsumerReference) bool { return r.UID == p.UID }) {
		return nil, transient{fmt.Errorf("claim %s is not allocated to the pod yet", claim)}
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	var out []string
	for _, r := range c.Status.Allocation.Devices.Results {
		addr, ok := n.devices[r.Device]
		if r.Driver != v1alpha1.GPUDriver || r.Pool != n.cfg.Name || !ok {
			return nil, fmt.Errorf("claim %s was allocated device %s/%s/%s, which this host does not publish", claim, r.Driver, r.Pool, r.Device)
		}
		out = append(out, addr)
	}
	if len(out) != count {
		return nil, fmt.Errorf("claim %s was allocated %d GPUs, the AgentVM asks for %d", claim, len(out), count)
	}
	slices.Sort(out)
	return out, nil
}

// report writes a run's report into its pod's status, when it changed.
func (n *Node) report(ctx context.Context, p *corev1.Pod, r v1alpha1.HostReport) {
	b, err := json.Marshal(r)
	if err != nil || len(b) > v1alpha1.MaxHostReport {
		r.Message = truncate(r.Message, 1024)
		b, _ = json.Marshal(r)
	}
	msg := string(b)
	n.mu.Lock()
	same := n.reported[p.UID] == msg
	n.mu.Unlock()
	if same {
		return
	}
	q := p.DeepCopy()
	now := metav1.Now()
	setCondition(q, corev1.PodCondition{Type: v1alpha1.ConditionVM, Status: corev1.ConditionTrue, Reason: r.Phase, Message: msg, LastTransitionTime: now})
	readyStatus := corev1.ConditionFalse
	switch node.Phase(r.Phase) {
	case node.Running:
		q.Status.Phase = corev1.PodRunning
		readyStatus = corev1.ConditionTrue
	case node.Stopped:
		q.Status.Phase = corev1.PodSucceeded
	case node.Failed:
		q.Status.Phase = corev1.PodFailed
	case node.Booting:
		if q.Status.Phase == "" {
			q.Status.Phase = corev1.PodPending
		}
	}
	// A pod that ended stays ended (the API server holds it to that).
	if p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
		q.Status.Phase = p.Status.Phase
	}
	setCondition(q, corev1.PodCondition{Type: corev1.PodReady, Status: readyStatus, LastTransitionTime: now})
	q.Status.Reason, q.Status.Message = r.Reason, r.Message
	if q.Status.StartTime == nil {
		q.Status.StartTime = &now
	}
	if _, err := n.cs.CoreV1().Pods(p.Namespace).UpdateStatus(ctx, q, metav1.UpdateOptions{}); err != nil {
		if !apierrors.IsConflict(err) && !apierrors.IsNotFound(err) {
			n.log.Warn("pod status not written", "pod", p.Namespace+"/"+p.Name, "err", err)
		}
		return
	}
	n.mu.Lock()
	n.reported[p.UID] = msg
	n.mu.Unlock()
}

func setCondition(p *corev1.Pod, c corev1.PodCondition) {
	for i, have := range p.Status.Conditions {
		if have.Type == c.Type {
			if have.Status == c.Status {
				c.LastTransitionTime = have.LastTransitionTime
			}
			p.Status.Conditions[i] = c
			return
		}
	}
	p.Status.Conditions = append(p.Status.Conditions, c)
}

// Capacity is this host's CPUs and memory, for the Node.
func Capacity() (cpus, memory int64) {
	cpus = int64(goruntime.NumCPU())
	b, err := os.ReadFile("/proc/meminfo")
	if err == nil {
		for l := range strings.Lines(string(b)) {
			if f := strings.Fields(l); len(f) >= 2 && f[0] == "MemTotal:" {
				kb, _ := strconv.ParseInt(f[1], 10, 64)
				memory = kb << 10
			}
		}
	}
	return cpus, memory
}
