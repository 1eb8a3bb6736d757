package main

import (
	"context"
	"fmt"
	"log"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"

	"github.com/carrel-os/carrel/supervisor/fleet/controller"
	"github.com/carrel-os/carrel/supervisor/fleet/v1alpha1"
	"github.com/carrel-os/carrel/tests/fleet/cluster"
	"github.com/carrel-os/carrel/tests/harness"
)

// realVMs of the AgentVMs go to the one real host (its driver, qemu,
// is the simulated hosts' kwok), to boot for real under the load.
const realVMs = 3

// fleetConfig sizes the simulated fleet.
type fleetConfig struct {
	nodes, gpus, vms, lost int
	lossTimeout            time.Duration
	limit                  time.Duration
}

// kwok marks the simulated hosts' runs Running as a host's carreld
// would report them: with the carrel.dev/VM condition.
const runStage = `apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: carrel-run-running
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.phase'
      operator: 'In'
      values: ['Pending']
  next:
    statusTemplate: |
      {{ $now := Now }}
      phase: Running
      startTime: {{ $now | Quote }}
      conditions:
      - lastTransitionTime: {{ $now | Quote }}
        status: "True"
        type: Ready
      - lastTransitionTime: {{ $now | Quote }}
        status: "True"
        type: carrel.dev/VM
        reason: Running
        message: '{"phase":"Running","session":"ses_kwok"}'
`

// benchFleet places AgentVMs through the real control plane onto
// simulated hosts (kwok) and one real carreld, and checks the placement.
func benchFleet(t *tb, cfg fleetConfig) {
	start := time.Now()
	c := cluster.Start(t, cluster.User{Name: "system:serviceaccount:carrel-system:carrel-controller", Groups: []string{"system:serviceaccounts"}},
		cluster.User{Name: "system:node:carrel-real", Groups: []string{"system:nodes", "carrel:nodes"}},
		cluster.User{Name: "carrel-bench-kwok", Groups: []string{"system:masters"}})
	bin := harness.Bins(t)
	tools := cluster.Bin(t)
	cs := c.Clientset(c.Admin)
	ctx := context.Background()
	log.Printf("fleet: control plane up in %s", time.Since(start).Round(time.Millisecond))

	out, err := exec.Command(filepath.Join(bin, "carrel"), "fleet", "manifests", "--no-controller").Output()
	if err != nil {
		t.Fatalf("carrel fleet manifests: %v", err)
	}
	c.Apply(out)
	ctrl := c.Run("carrel-controller", filepath.Join(bin, "carrel-controller"), "--kubeconfig", c.Kubeconfig("system:serviceaccount:carrel-system:carrel-controller"),
		"--node-loss-timeout", cfg.lossTimeout.String(), "--kube-api-qps", "2000", "--kube-api-burst", "4000", "--workers", "16")

	// The simulated hosts: Nodes as carreld registers them, with a slice
	// of GPUs each, made ready and kept alive by kwok.
	t0 := time.Now()
	parallel(cfg.nodes, 32, func(i int) {
		name := fmt.Sprintf("sim-%04d", i)
		n := &corev1.Node{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"kwok.x-k8s.io/node": "fake",
				v1alpha1.LabelHost: "true", v1alpha1.LabelAdmitted: "true", v1alpha1.LabelDriver: "kwok", "kubernetes.io/hostname": name, "type": "kwok"}},
			Spec:   corev1.NodeSpec{Taints: []corev1.Taint{{Key: v1alpha1.TaintHost, Value: "true", Effect: corev1.TaintEffectNoSchedule}}},
			Status: corev1.NodeStatus{Allocatable: simCapacity(), Capacity: simCapacity()},
		}
		if _, err := cs.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{}); err != nil {
			t.Fatalf("node %s: %v", name, err)
		}
		var devs []resourcev1.Device
		for g := range cfg.gpus {
			addr := fmt.Sprintf("0000:%02x:00.0", 0x10+g)
			devs = append(devs, resourcev1.Device{Name: fmt.Sprintf("gpu-0000-%02x-00-0", 0x10+g), Attributes: map[resourcev1.QualifiedName]resourcev1.DeviceAttribute{
				"pciAddress": {StringValue: ptr.To(addr)}, "model": {StringValue: ptr.To("H100")}}})
		}
		s := &resourcev1.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: name + "-" + v1alpha1.GPUDriver}, Spec: resourcev1.ResourceSliceSpec{
			Driver: v1alpha1.GPUDriver, NodeName: ptr.To(name), Devices: devs,
			Pool: resourcev1.ResourcePool{Name: name, Generation: 1, ResourceSliceCount: 1}}}
		if _, err := cs.ResourceV1().ResourceSlices().Create(ctx, s, metav1.CreateOptions{}); err != nil {
			t.Fatalf("slice of %s: %v", name, err)
		}
	})
	log.Printf("fleet: %d simulated hosts with %d GPUs each registered in %s", cfg.nodes, cfg.gpus, time.Since(t0).Round(time.Millisecond))
	stages := filepath.Join(filepath.Dir(tools), "stages")
	stageFile := filepath.Join(c.Dir, "carrel-run-running.yaml")
	if err := os.WriteFile(stageFile, []byte(runStage), 0o644); err != nil {
		t.Fatal(err)
	}
	c.Run("kwok", filepath.Join(tools, "kwok"), "--kubeconfig", c.Kubeconfig("carrel-bench-kwok"),
		"--config", strings.Join([]string{filepath.Join(stages, "node-initialize.yaml"), filepath.Join(stages, "node-heartbeat-with-lease.yaml"),
			stageFile, filepath.Join(stages, "pod-delete.yaml")}, ","),
		"--manage-nodes-with-label-selector", "kwok.x-k8s.io/node=fake", "--node-ip", "127.0.0.1", "--node-lease-duration-seconds", "40")

	// One real host.
	d := harness.New(t, "--kubeconfig", c.Kubeconfig("system:node:carrel-real"), "--node-name", "carrel-real",
		"--fleet-cpus", "4", "--fleet-memory", "6G", "--fleet-renew-interval", "2s", "--fleet-fence-after", (cfg.lossTimeout / 2).String())
	d.Start()
	d.BuildImage()
	c.WaitFor("carrel-real admitted", time.Minute, func() (bool, error) {
		n, err := cs.CoreV1().Nodes().Get(ctx, "carrel-real", metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		n.Labels[v1alpha1.LabelAdmitted] = "true"
		_, err = cs.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
		return err == nil, nil
	})
	c.WaitFor("every host Ready, with no taint but carrel's", 5*time.Minute, func() (bool, error) {
		nodes, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		ready := 0
		for _, n := range nodes.Items {
			if slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key != v1alpha1.TaintHost }) {
				continue
			}
			for _, cd := range n.Status.Conditions {
				if cd.Type == corev1.NodeReady && cd.Status == corev1.ConditionTrue {
					ready++
				}
			}
		}
		return ready == cfg.nodes+1, nil
	})

	// Watch every AgentVM's phase from the start.
	avms := c.Dynamic(c.Admin).Resource(v1alpha1.GroupVersion.WithResource("agentvms")).Namespace("default")
	// An informer, which lists again and watches on when the API server
	// drops a watcher that falls behind (as it does under this load).
	tr := newTracker()
	inf := dynamicinformer.NewFilteredDynamicInformer(c.Dynamic(c.Admin), v1alpha1.GroupVersion.WithResource("agentvms"), "default", 0, cache.Indexers{}, nil)
	if _, err := inf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    tr.seen,
		UpdateFunc: func(_, o any) { tr.seen(o) },
	}); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	defer close(stop)
	go inf.Informer().Run(stop)

	// The workload: 90% 2 vCPU / 4 GiB, 10% with 1 to 8 GPUs.
	rng := rand.New(rand.NewPCG(1, 2))
	gpuOf := make([]int, cfg.vms)
	for i := range gpuOf {
		if rng.IntN(10) == 0 {
			gpuOf[i] = 1 + rng.IntN(8)
		}
	}
	bare := benchBarePods(t, c, cs, gpuOf)

	createStart := time.Now()
	parallel(cfg.vms, 32, func(i int) {
		spec := map[string]any{"image": "dev", "cpus": int64(2), "memory": "4Gi", "onNodeLoss": "Recreate"}
		if g := gpuOf[i]; g > 0 {
			spec["gpus"] = map[string]any{"count": int64(g)}
		}
		if i < realVMs {
			// Booted for real, under the load: only carrel-real runs qemu.
			spec = map[string]any{"image": "dev", "cpus": int64(1), "memory": "512Mi", "driver": "qemu"}
		}
		name := fmt.Sprintf("avm-%05d", i)
		u := &unstructured.Unstructured{Object: map[string]any{"apiVersion": v1alpha1.GroupVersion.String(), "kind": "AgentVM",
			"metadata": map[string]any{"name": name}, "spec": spec}}
		tr.created(name)
		if _, err := avms.Create(ctx, u, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create %s: %v", name, err)
		}
	})
	created := time.Since(createStart)
	log.Printf("fleet: %d AgentVMs created in %s (%.0f/s)", cfg.vms, created.Round(time.Millisecond), float64(cfg.vms)/created.Seconds())
	c.WaitFor("every AgentVM Running", cfg.limit, func() (bool, error) { return tr.running() == cfg.vms, nil })
	all := time.Since(createStart)
	lat := tr.latencies()
	log.Printf("fleet: all %d Running %s after the first create: %.1f placements/s; create→Running p50 %s, p99 %s, max %s",
		cfg.vms, all.Round(time.Millisecond), float64(cfg.vms)/all.Seconds(), pct(lat, 50), pct(lat, 99), pct(lat, 100))
	log.Printf("fleet: AgentVMs ÷ the same pods made directly (the floor): %.2f× the time to all Running", all.Seconds()/bare.Seconds())
	for _, p := range []string{"etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "carrel-controller", "kwok"} {
		log.Printf("fleet: %-24s peak RSS %s", p, peakRSS(c, p))
	}
	log.Printf("fleet: %-24s peak RSS %s (the real host's node helper)", "carrel-node", pidRSS(childNamed(d.Pid(), "carrel-node")))
	log.Printf("fleet: %-24s peak RSS %s (the real host, %d VMs)", "carreld", pidRSS(d.Pid()), realVMs)

	checkPlacement(t, cs, cfg)
	real := tr.onNode("carrel-real")
	if len(real) < realVMs {
		t.Fatalf("%d AgentVMs run on carrel-real, want %d", len(real), realVMs)
	}
	log.Printf("fleet: %d AgentVMs booted for real on carrel-real, under the load:\n%s", len(real), strings.TrimSpace(d.Must("vm", "ls")))

	// Lose hosts: kwok stops renewing the Leases of hosts that run
	// AgentVMs; each must be Lost and running again elsewhere in time.
	var lost []string
	for _, n := range tr.nodesInUse() {
		if strings.HasPrefix(n, "sim-") && len(lost) < cfg.lost {
			lost = append(lost, n)
		}
	}
	var victims []string
	for _, n := range lost {
		victims = append(victims, tr.onNode(n)...)
	}
	runs := map[string]int32{}
	for _, v := range victims {
		runs[v] = tr.run(v)
	}
	lostAt := time.Now()
	parallel(len(lost), 16, func(i int) {
		n, err := cs.CoreV1().Nodes().Get(ctx, lost[i], metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		// kwok's watch, by label, sees the node go: it stops renewing.
		n.Labels["kwok.x-k8s.io/node"] = "lost"
		if _, err := cs.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	})
	bound := cfg.lossTimeout + cfg.lossTimeout/2 + 60*time.Second
	for deadline := time.Now().Add(bound); ; time.Sleep(200 * time.Millisecond) {
		waiting := map[string]int{}
		for _, v := range victims {
			if tr.run(v) <= runs[v] || tr.phase(v) != v1alpha1.PhaseRunning || slices.Contains(lost, tr.node(v)) {
				waiting[fmt.Sprintf("run %d %s: %.200s", tr.run(v), tr.phase(v), tr.message(v))]++
			}
		}
		if len(waiting) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the AgentVMs of %d lost hosts not all running again elsewhere %s later: %v", len(lost), bound, waiting)
		}
	}
	log.Printf("fleet: %d hosts lost (their Leases stopped): all %d of their AgentVMs Lost and running again elsewhere %s later (node-loss-timeout %s)",
		len(lost), len(victims), time.Since(lostAt).Round(time.Millisecond), cfg.lossTimeout)
	checkPlacement(t, cs, cfg)
	ctrl.Stop()
	log.Printf("fleet: done in %s", time.Since(start).Round(time.Second))
}

// benchBarePods is the floor: the pods carrel-controller would make for
// the same workload, made directly (no AgentVM, no controller, no
// finalizer), placed by the same scheduler and marked Running by kwok on
// the simulated hosts. It returns the time from the first create until
// all run, and deletes them.
func benchBarePods(t *tb, c *cluster.Cluster, cs *kubernetes.Clientset, gpuOf []int) time.Duration {
	ctx := context.Background()
	const ns = "bare"
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for g := 1; g <= 8; g++ {
		avm := &v1alpha1.AgentVM{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("g%d", g), Namespace: ns}, Spec: v1alpha1.AgentVMSpec{GPUs: &v1alpha1.GPURequest{Count: int32(g)}}}
		tmpl := &resourcev1.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: controller.TemplateName(avm.Name), Namespace: ns},
			Spec: resourcev1.ResourceClaimTemplateSpec{Spec: resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{
				Requests: []resourcev1.DeviceRequest{{Name: v1alpha1.GPUClaim, Exactly: &resourcev1.ExactDeviceRequest{
					DeviceClassName: v1alpha1.GPUDriver, AllocationMode: resourcev1.DeviceAllocationModeExactCount, Count: int64(g)}}}}}}}
		if _, err := cs.ResourceV1().ResourceClaimTemplates(ns).Create(ctx, tmpl, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	start := time.Now()
	parallel(len(gpuOf), 32, func(i int) {
		avm := &v1alpha1.AgentVM{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("g%d", gpuOf[i]), Namespace: ns},
			Spec: v1alpha1.AgentVMSpec{CPUs: 2, Memory: ptr.To(resource.MustParse("4Gi")), Driver: "kwok"}}
		if g := gpuOf[i]; g > 0 {
			avm.Spec.GPUs = &v1alpha1.GPURequest{Count: int32(g)}
		}
		p := controller.PodFor(avm, &v1alpha1.AgentVMStatus{Pod: fmt.Sprintf("bare-%05d", i)})
		p.Labels, p.Finalizers = nil, nil
		if _, err := cs.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create bare pod: %v", err)
		}
	})
	c.WaitFor("every bare pod Running", 20*time.Minute, func() (bool, error) {
		pods, err := cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{FieldSelector: "status.phase=Running"})
		return err == nil && len(pods.Items) == len(gpuOf), nil
	})
	took := time.Since(start)
	log.Printf("fleet: floor: the same %d pods made directly all Running %s after the first create: %.1f placements/s",
		len(gpuOf), took.Round(time.Millisecond), float64(len(gpuOf))/took.Seconds())
	if err := cs.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	c.WaitFor("the bare pods gone", 10*time.Minute, func() (bool, error) {
		pods, err := cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{Limit: 1})
		return err == nil && len(pods.Items) == 0, nil
	})
	return took
}

func simCapacity() corev1.ResourceList {
	return corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("128"), corev1.ResourceMemory: resource.MustParse("1Ti"), corev1.ResourcePods: resource.MustParse("110")}
}

// checkPlacement checks no GPU is in two claims and no host holds more
// than it offers.
func checkPlacement(t *tb, cs *kubernetes.Clientset, cfg fleetConfig) {
	ctx := context.Background()
	claims, err := cs.ResourceV1().ResourceClaims("").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	held := map[string]string{}
	perNode := map[string]int{}
	for _, cl := range claims.Items {
		if cl.Status.Allocation == nil {
			continue
		}
		for _, r := range cl.Status.Allocation.Devices.Results {
			key := r.Pool + "/" + r.Device
			if other, ok := held[key]; ok {
				t.Fatalf("GPU %s is in claims %s and %s", key, other, cl.Name)
			}
			held[key] = cl.Name
			perNode[r.Pool]++
		}
	}
	for n, k := range perNode {
		if k > cfg.gpus {
			t.Fatalf("host %s has %d GPUs allocated of %d", n, k, cfg.gpus)
		}
	}
	nodes, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pods, err := cs.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	type use struct{ cpu, mem resource.Quantity }
	used := map[string]*use{}
	for _, p := range pods.Items {
		if p.Spec.NodeName == "" || p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		u := used[p.Spec.NodeName]
		if u == nil {
			u = &use{}
			used[p.Spec.NodeName] = u
		}
		for _, ctr := range p.Spec.Containers {
			u.cpu.Add(*ctr.Resources.Requests.Cpu())
			u.mem.Add(*ctr.Resources.Requests.Memory())
		}
	}
	for _, n := range nodes.Items {
		u := used[n.Name]
		if u == nil {
			continue
		}
		if u.cpu.Cmp(*n.Status.Allocatable.Cpu()) > 0 || u.mem.Cmp(*n.Status.Allocatable.Memory()) > 0 {
			t.Fatalf("host %s holds cpu %s, memory %s: over its %s, %s", n.Name, &u.cpu, &u.mem, n.Status.Allocatable.Cpu(), n.Status.Allocatable.Memory())
		}
	}
	log.Printf("fleet: placement checked: %d GPUs allocated, none twice; %d hosts in use, none over its CPUs, memory or GPUs", len(held), len(used))
}

// tracker follows AgentVMs' phases from a watch.
type tracker struct {
	mu   sync.Mutex
	made map[string]time.Time
	ran  map[string]time.Duration // first create→Running
	st   map[string]v1alpha1.AgentVMStatus
}

func newTracker() *tracker {
	return &tracker{made: map[string]time.Time{}, ran: map[string]time.Duration{}, st: map[string]v1alpha1.AgentVMStatus{}}
}

func (tr *tracker) created(name string) {
	tr.mu.Lock()
	tr.made[name] = time.Now()
	tr.mu.Unlock()
}

func (tr *tracker) seen(o any) {
	u, ok := o.(*unstructured.Unstructured)
	if !ok {
		return
	}
	var a v1alpha1.AgentVM
	if runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &a) != nil {
		return
	}
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.st[a.Name] = a.Status
	// create→Running by the objects' own times (the API server's and the
	// controller's clocks, this machine's both; to the second), not by
	// when this watcher heard, which lags under load.
	if _, seen := tr.ran[a.Name]; !seen && a.Status.Phase == v1alpha1.PhaseRunning {
		if c := meta.FindStatusCondition(a.Status.Conditions, "Ready"); c != nil && c.Status == metav1.ConditionTrue {
			tr.ran[a.Name] = c.LastTransitionTime.Sub(a.CreationTimestamp.Time)
		}
	}
}

func (tr *tracker) running() int {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	n := 0
	for _, s := range tr.st {
		if s.Phase == v1alpha1.PhaseRunning {
			n++
		}
	}
	return n
}

func (tr *tracker) latencies() []time.Duration {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	var out []time.Duration
	for _, d := range tr.ran {
		out = append(out, d)
	}
	slices.Sort(out)
	return out
}

func (tr *tracker) onNode(node string) []string {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	var out []string
	for n, s := range tr.st {
		if s.Node == node && s.Phase == v1alpha1.PhaseRunning {
			out = append(out, n)
		}
	}
	slices.Sort(out)
	return out
}

func (tr *tracker) nodesInUse() []string {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	set := map[string]bool{}
	for _, s := range tr.st {
		if s.Node != "" {
			set[s.Node] = true
		}
	}
	var out []string
	for n := range set {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

func (tr *tracker) run(name string) int32 {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return tr.st[name].Run
}

func (tr *tracker) phase(name string) v1alpha1.Phase {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return tr.st[name].Phase
}

func (tr *tracker) message(name string) string {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return tr.st[name].Message
}

func (tr *tracker) node(name string) string {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return tr.st[name].Node
}

func pct(d []time.Duration, p int) time.Duration {
	if len(d) == 0 {
		return 0
	}
	i := (len(d)*p+99)/100 - 1
	return d[max(0, min(i, len(d)-1))].Round(time.Millisecond)
}

// parallel runs fn(0..n-1) on k goroutines.
func parallel(n, k int, fn func(int)) {
	var wg sync.WaitGroup
	next := make(chan int)
	for range k {
		wg.Go(func() {
			for i := range next {
				fn(i)
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
}

// peakRSS is a cluster process's peak resident set (VmHWM).
func peakRSS(c *cluster.Cluster, name string) string {
	p := c.Proc(name)
	if p == nil {
		return "?"
	}
	return pidRSS(p.Cmd.Process.Pid)
}

// childNamed is the pid of parent's child running comm, or 0.
func childNamed(parent int, comm string) int {
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...
		s := string(b)
		i, j := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
		if i < 0 || j < i {
			continue
		}
		f := strings.Fields(s[j+1:])
		if s[i+1:j] == comm && len(f) > 1 && f[1] == strconv.Itoa(parent) {
			return pid
		}
	}
	return 0
}

// pidRSS is a process's peak resident set (VmHWM).
func pidRSS(pid int) string {
	if pid == 0 {
		return "?"
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return "?"
	}
	for l := range strings.Lines(string(b)) {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmHWM:" {
			kb, _ := strconv.Atoi(f[1])
			return fmt.Sprintf("%d MiB", kb>>10)
		}
	}
	return "?"
}
