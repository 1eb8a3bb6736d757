package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/carrel-os/carrel/supervisor/fleet/v1alpha1"
	"github.com/carrel-os/carrel/supervisor/gpu/gputest"
	"github.com/carrel-os/carrel/tests/fleet/cluster"
	"github.com/carrel-os/carrel/tests/harness"
)

// fleet is the fleet tests' world: a real control plane, the CRDs and
// RBAC `carrel fleet manifests` prints, carrel-controller, and two real
// carreld hosts booting real VMs.
type fleet struct {
	t     *testing.T
	c     *cluster.Cluster
	cs    *kubernetes.Clientset
	avms  dynamic.ResourceInterface
	hosts map[string]*harness.Daemon
	ctrl  *cluster.Proc
	bin   string
}

const (
	fleetNS          = "default"
	fleetLossTimeout = 24 * time.Second
	fleetFenceAfter  = 10 * time.Second
)

var controllerUser = cluster.User{Name: "system:serviceaccount:carrel-system:carrel-controller", Groups: []string{"system:serviceaccounts", "system:serviceaccounts:carrel-system"}}

func nodeUser(name string) cluster.User {
	return cluster.User{Name: "system:node:" + name, Groups: []string{"system:nodes", "carrel:nodes"}}
}

// startFleet starts it all. Host carrel-a has one GPU, from a fake sysfs.
func startFleet(t *testing.T) *fleet {
	harness.RequireVM(t)
	c := cluster.Start(t, controllerUser, nodeUser("carrel-a"), nodeUser("carrel-b"))
	f := &fleet{t: t, c: c, cs: c.Clientset(c.Admin), hosts: map[string]*harness.Daemon{}, bin: harness.Bins(t)}
	f.avms = c.Dynamic(c.Admin).Resource(v1alpha1.GroupVersion.WithResource("agentvms")).Namespace(fleetNS)

	// What an operator applies: made by the CLI of this build.
	manifests := runOut(t, filepath.Join(f.bin, "carrel"), "fleet", "manifests", "--no-controller", "--node-loss-timeout", fleetLossTimeout.String())
	c.Apply([]byte(manifests))
	f.startController()

	sysfs := gputest.New(t, gputest.Drivers...)
	sysfs.Add(gputest.NVIDIAWithAudio()...)
	for _, name := range []string{"carrel-a", "carrel-b"} {
		args := []string{"--kubeconfig", c.Kubeconfig("system:node:" + name), "--node-name", name,
			"--fleet-fence-after", fleetFenceAfter.String(), "--fleet-renew-interval", "2s",
			"--fleet-cpus", "4", "--fleet-memory", "6G"}
		if name == "carrel-a" {
			args = append(args, "--fleet-fake-gpus", sysfs.Root)
		}
		d := harness.New(t, args...)
		d.Start()
		d.BuildImage()
		f.hosts[name] = d
	}
	for name := range f.hosts {
		f.admit(name)
		f.waitFor("node "+name+" Ready", 60*time.Second, func() bool {
			n, err := f.cs.CoreV1().Nodes().Get(context.Background(), name, metav1.GetOptions{})
			if err != nil {
				return false
			}
			for _, cd := range n.Status.Conditions {
				if cd.Type == corev1.NodeReady && cd.Status == corev1.ConditionTrue {
					return true
				}
			}
			return false
		})
	}
	return f
}

// admit labels a host's Node as an administrator admits it to the fleet.
func (f *fleet) admit(name string) {
	f.t.Helper()
	ctx := context.Background()
	f.waitFor("node "+name+" registered", 60*time.Second, func() bool {
		n, err := f.cs.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false
		}
		n.Labels[v1alpha1.LabelAdmitted] = "true"
		_, err = f.cs.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
		return err == nil
	})
}

func (f *fleet) startController() {
	f.ctrl = f.c.Run("carrel-controller", filepath.Join(f.bin, "carrel-controller"),
		"--kubeconfig", f.c.Kubeconfig(controllerUser.Name), "--node-loss-timeout", fleetLossTimeout.String())
}

func runOut(t *testing.T, argv ...string) string {
	t.Helper()
	out, err := exec.Command(argv[0], argv[1:]...).Output()
	if err != nil {
		t.Fatalf("%v: %v", argv, err)
	}
	return string(out)
}

// waitFor polls cond every 250 ms for up to limit.
func (f *fleet) waitFor(what string, limit time.Duration, cond func() bool) {
	f.t.Helper()
	f.c.WaitForIn(f.t, what, limit, func() (bool, error) { return cond(), nil })
}

// create makes an AgentVM.
func (f *fleet) create(name string, spec map[string]any) {
	f.t.Helper()
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": v1alpha1.GroupVersion.String(), "kind": "AgentVM",
		"metadata": map[string]any{"name": name}, "spec": spec,
	}}
	if _, err := f.avms.Create(context.Background(), u, metav1.CreateOptions{}); err != nil {
		f.t.Fatalf("create AgentVM %s: %v", name, err)
	}
}

func (f *fleet) get(name string) *v1alpha1.AgentVM {
	f.t.Helper()
	u, err := f.avms.Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		f.t.Fatal(err)
	}
	var a v1alpha1.AgentVM
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &a); err != nil {
		f.t.Fatal(err)
	}
	return &a
}

// waitPhase waits for an AgentVM's phase (and, with run > 0, its run).
func (f *fleet) waitPhase(name string, phase v1alpha1.Phase, run int32, limit time.Duration) *v1alpha1.AgentVM {
	f.t.Helper()
	var a *v1alpha1.AgentVM
	f.waitFor(fmt.Sprintf("AgentVM %s %s (run %d)", name, phase, run), limit, func() bool {
		a = f.get(name)
		return a != nil && a.Status.Phase == phase && (run == 0 || a.Status.Run == run)
	})
	return a
}

func (f *fleet) delete(name string) {
	f.t.Helper()
	if err := f.avms.Delete(context.Background(), name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		f.t.Fatal(err)
	}
}

// vmsNamed lists the hosts that have a VM of the name, running or not.
func (f *fleet) vmsNamed(name string) []string {
	f.t.Helper()
	var on []string
	for host, d := range f.hosts {
		for _, v := range list(f.t, d) {
			if v.Name == name {
				on = append(on, host)
			}
		}
	}
	slices.Sort(on)
	return on
}

// session is the session of host's VM of the name.
func (f *fleet) vmSession(host, name string) string {
	f.t.Helper()
	out := f.hosts[host].Must("vm", "inspect", name)
	var v struct {
		Session string `json:"session"`
	}
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		f.t.Fatalf("vm get %s: %v\n%s", name, err, out)
	}
	return v.Session
}

func (f *fleet) other(host string) string {
	if host == "carrel-a" {
		return "carrel-b"
	}
	return "carrel-a"
}

// TestFleet runs AgentVMs on two real carreld hosts under a real
// Kubernetes control plane.
func TestFleet(t *testing.T) {
	f := startFleet(t)
	ctx := context.Background()

	t.Run("CreateRunningExec", func(t *testing.T) {
		f.t = t
		f.create("a1", map[string]any{"image": "dev", "cpus": 1, "memory": "512Mi"})
		a := f.waitPhase("a1", v1alpha1.PhaseRunning, 1, 180*time.Second)
		host := a.Status.Node
		if f.hosts[host] == nil || a.Status.Pod != "a1-1" {
			t.Fatalf("a1 runs on %q as pod %q", host, a.Status.Pod)
		}
		if out := f.hosts[host].Must("exec", "a1", "--", "echo", "hello from the fleet"); out != "hello from the fleet\n" {
			t.Fatalf("exec on %s: %q", host, out)
		}
		// As an operator elsewhere would: carrel --host, over ssh (a stand-in
		// here, which runs the remote command on this machine).
		if out := f.remote(host, "exec", "a1", "--", "echo", "hello over ssh"); out != "hello over ssh\n" {
			t.Errorf("carrel --host %s exec: %q", host, out)
		}
		if s := f.vmSession(host, "a1"); s == "" || s != a.Status.Session {
			t.Errorf("AgentVM session %q, the host's VM's %q", a.Status.Session, s)
		}
		if got := f.vmsNamed("a1"); !slices.Equal(got, []string{host}) {
			t.Errorf("VMs named a1 on %v, want on %s alone", got, host)
		}
		f.waitFor("a1's audit checkpoint", 30*time.Second, func() bool {
			a = f.get("a1")
			return a.Status.AuditCheckpoint != nil && a.Status.AuditCheckpoint.Size > 0
		})
		// Deleting the AgentVM stops and deletes its VM, recorded.
		f.delete("a1")
		f.waitFor("a1's VM deleted", 90*time.Second, func() bool { return len(f.vmsNamed("a1")) == 0 })
		f.gracefulStop(host, "a1")
	})

	t.Run("Policy", func(t *testing.T) {
		f.t = t
		// The default bundle's data, with uname denied: a Policy as an
		// operator would write one from carrel's own.
		b, err := os.ReadFile(filepath.Join(harness.RepoRoot(), "policy", "bundle", "data.json"))
		if err != nil {
			t.Fatal(err)
		}
		var data map[string]any
		if err := json.Unmarshal(b, &data); err != nil {
			t.Fatal(err)
		}
		data["settings"].(map[string]any)["exec"].(map[string]any)["denied_commands"] = []any{"uname"}
		b, _ = json.Marshal(data)
		// A bundle brings its tests: this one's, that uname is denied.
		test := `package no_uname_test

import data.carrel.exec

test_uname_denied if {
	d := exec.decision with input as {"version": 1, "vm": "p1", "caller": {"type": "peer", "uid": 0},
		"argv": ["uname"], "env": {}, "cwd": "/workspace", "user": "agent", "tty": false}
	d.allow == false
	d.rule == "carrel.exec.denied_command"
}
`
		pol := &unstructured.Unstructured{Object: map[string]any{"apiVersion": v1alpha1.GroupVersion.String(), "kind": "Policy",
			"metadata": map[string]any{"name": "no-uname"}, "spec": map[string]any{"files": map[string]any{
				"data.json": string(b), "no_uname_test.rego": test}}}}
		if _, err := f.c.Dynamic(f.c.Admin).Resource(v1alpha1.GroupVersion.WithResource("policies")).Namespace(fleetNS).Create(ctx, pol, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		f.create("p1", map[string]any{"image": "dev", "memory": "512Mi", "policyRef": "no-uname"})
		a := f.waitPhase("p1", v1alpha1.PhaseRunning, 1, 180*time.Second)
		d := f.hosts[a.Status.Node]
		var v struct {
			Policy string `json:"policy"`
		}
		if err := json.Unmarshal([]byte(d.Must("vm", "inspect", "p1")), &v); err != nil || v.Policy != v1alpha1.HostPolicyName(fleetNS, "no-uname") {
			t.Errorf("p1's policy on its host: %q, %v; want %s", v.Policy, err, v1alpha1.HostPolicyName(fleetNS, "no-uname"))
		}
		if r := d.Carrel("exec", "p1", "--", "uname"); r.Code == 0 || !strings.Contains(r.Stderr, "denied") {
			t.Errorf("uname in p1 under the Policy: exit %d, %q", r.Code, r.Stderr)
		}
		if out := d.Must("exec", "p1", "--", "echo", "allowed"); out != "allowed\n" {
			t.Errorf("echo in p1: %q", out)
		}
		f.delete("p1")
		f.waitFor("p1's VM deleted", 90*time.Second, func() bool { return len(f.vmsNamed("p1")) == 0 })
	})

	t.Run("GPUPlacement", func(t *testing.T) {
		f.t = t
		f.create("g1", map[string]any{"image": "dev", "memory": "512Mi", "gpus": map[string]any{"count": 1}})
		a := f.waitPhase("g1", v1alpha1.PhaseRunning, 1, 180*time.Second)
		if a.Status.Node != "carrel-a" || !slices.Equal(a.Status.GPUs, []string{gputest.NVIDIAGPU}) {
			t.Fatalf("g1 on %s with GPUs %v, want carrel-a with %s", a.Status.Node, a.Status.GPUs, gputest.NVIDIAGPU)
		}
		// The one GPU is taken: a second waits, exactly counted.
		f.create("g2", map[string]any{"image": "dev", "memory": "512Mi", "gpus": map[string]any{"count": 1}})
		time.Sleep(8 * time.Second)
		if b := f.get("g2"); b.Status.Phase != v1alpha1.PhasePending || b.Status.Node != "" {
			t.Fatalf("g2 is %s on %q while g1 holds the only GPU", b.Status.Phase, b.Status.Node)
		}
		f.delete("g1")
		b := f.waitPhase("g2", v1alpha1.PhaseRunning, 1, 180*time.Second)
		if b.Status.Node != "carrel-a" || !slices.Equal(b.Status.GPUs, []string{gputest.NVIDIAGPU}) {
			t.Fatalf("g2 on %s with GPUs %v", b.Status.Node, b.Status.GPUs)
		}
		f.delete("g2")
		f.waitFor("g2's VM deleted", 90*time.Second, func() bool { return len(f.vmsNamed("g2")) == 0 })
	})

	t.Run("Drain", func(t *testing.T) {
		f.t = t
		f.create("d1", map[string]any{"image": "dev", "memory": "512Mi"})
		f.create("d2", map[string]any{"image": "dev", "memory": "512Mi", "onNodeLoss": "Recreate"})
		a := f.waitPhase("d1", v1alpha1.PhaseRunning, 1, 180*time.Second)
		b := f.waitPhase("d2", v1alpha1.PhaseRunning, 1, 180*time.Second)
		// d1 (onNodeLoss Fail) stops with its host's drain.
		h1 := a.Status.Node
		f.drain(h1)
		f.waitPhase("d1", v1alpha1.PhaseStopped, 1, 60*time.Second)
		if d1 := f.get("d1"); !strings.Contains(d1.Status.Message, "drain") {
			t.Errorf("d1 after the drain: %q", d1.Status.Message)
		}
		f.gracefulStop(h1, "d1")
		// d2 (Recreate) runs again on the other host after its own's.
		h2 := b.Status.Node
		if h2 != h1 {
			f.uncordon(h1)
			f.drain(h2)
		}
		d2 := f.waitPhase("d2", v1alpha1.PhaseRunning, 2, 180*time.Second)
		if d2.Status.Node == h2 {
			t.Errorf("d2's new run is on the drained host %s", h2)
		}
		f.gracefulStop(h2, "d2")
		f.uncordon(h1)
		f.uncordon(h2)
		f.delete("d1")
		f.delete("d2")
		f.waitFor("d1 and d2 deleted", 90*time.Second, func() bool { return len(f.vmsNamed("d1"))+len(f.vmsNamed("d2")) == 0 })
	})

	t.Run("LostHostIsFenced", func(t *testing.T) {
		f.t = t
		f.create("l1", map[string]any{"image": "dev", "memory": "512Mi", "onNodeLoss": "Recreate"})
		a := f.waitPhase("l1", v1alpha1.PhaseRunning, 1, 180*time.Second)
		lost := a.Status.Node
		d := f.hosts[lost]
		qemus := harness.QEMUPids(d.State)
		if len(qemus) != 1 {
			t.Fatalf("%d QEMUs under %s", len(qemus), lost)
		}
		syscall.Kill(d.Pid(), syscall.SIGSTOP)
		stopped := time.Now()
		b := f.waitPhase("l1", v1alpha1.PhaseRunning, 2, fleetLossTimeout+180*time.Second)
		if b.Status.Node == lost || !slices.Contains(b.Status.LostNodes, lost) {
			t.Errorf("l1's second run on %s, lost nodes %v", b.Status.Node, b.Status.LostNodes)
		}
		t.Logf("run 2 running on %s %s after SIGSTOP of %s", b.Status.Node, time.Since(stopped).Round(time.Second), lost)
		syscall.Kill(d.Pid(), syscall.SIGCONT)
		// Fenced at once: no call reaches the old VM, even before its stop.
		if r := d.Carrel("exec", "l1", "--", "true"); r.Code == 0 {
			t.Errorf("exec on the fenced host %s succeeded:\n%s", lost, r.Stdout)
		}
		f.waitFor("the old VM's QEMU gone from "+lost, 30*time.Second, func() bool { return len(harness.QEMUPids(d.State)) == 0 })
		f.waitFor("the old VM deleted from "+lost, 60*time.Second, func() bool { return !slices.Contains(f.vmsNamed("l1"), lost) })
		if out := f.hosts[b.Status.Node].Must("exec", "l1", "--", "echo", "ok"); out != "ok\n" {
			t.Errorf("exec on the new host: %q", out)
		}
		f.delete("l1")
		f.waitFor("l1 deleted", 90*time.Second, func() bool { return len(f.vmsNamed("l1")) == 0 })
	})

	t.Run("ControllerKilledMidCreate", func(t *testing.T) {
		f.t = t
		f.ctrl.Kill()
		f.create("k1", map[string]any{"image": "dev", "memory": "512Mi"})
		f.startController()
		// Kill it again the moment it has named the run, before or just
		// after it makes the pod.
		f.waitFor("k1's run named", 60*time.Second, func() bool { return f.get("k1").Status.Run == 1 })
		f.ctrl.Kill()
		f.startController()
		f.waitPhase("k1", v1alpha1.PhaseRunning, 1, 180*time.Second)
		pods, err := f.cs.CoreV1().Pods(fleetNS).List(ctx, metav1.ListOptions{LabelSelector: v1alpha1.LabelAgentVM + "=k1"})
		if err != nil || len(pods.Items) != 1 {
			t.Fatalf("pods of k1: %d, %v", len(pods.Items), err)
		}
		if got := f.vmsNamed("k1"); len(got) != 1 {
			t.Errorf("VMs named k1 on %v", got)
		}
		f.delete("k1")
	})
}

// drain cordons host and evicts its pods, as kubectl drain does, and
// waits for them to be gone.
func (f *fleet) drain(host string) {
	f.t.Helper()
	ctx := context.Background()
	n, err := f.cs.CoreV1().Nodes().Get(ctx, host, metav1.GetOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	n.Spec.Unschedulable = true
	if _, err := f.cs.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
		f.t.Fatal(err)
	}
	pods, err := f.cs.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + host})
	if err != nil {
		f.t.Fatal(err)
	}
	for _, p := range pods.Items {
		if p.DeletionTimestamp != nil || p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		ev := &policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace}}
		if err := f.cs.PolicyV1().Evictions(p.Namespace).Evict(ctx, ev); err != nil {
			f.t.Fatalf("evict %s: %v", p.Name, err)
		}
	}
	f.waitFor("pods gone from "+host, 120*time.Second, func() bool {
		left, err := f.cs.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + host})
		if err != nil {
			return false
		}
		for _, p := range left.Items {
			if p.Status.Phase != corev1.PodSucceeded && p.Status.Phase != corev1.PodFailed {
				return false
			}
		}
		return true
	})
}

// remote runs carrel --host HOST: a stand-in for ssh runs the remote
// side (carrel system dial-stdio) here, against HOST's carreld.
func (f *fleet) remote(host string, args ...string) string {
	f.t.Helper()
	dir := f.t.TempDir()
	ssh := filepath.Join(dir, "ssh")
	script := "#!/bin/sh\n# ssh OPTIONS -- DEST COMMAND...: run COMMAND here, for DEST's carreld\n" +
		"while [ \"$1\" != -- ]; do shift; done; shift; dest=$1; shift\n" +
		"exec env PATH=" + f.bin + ":$PATH CARREL_SOCKET=$(cat " + dir + "/$dest.sock) \"$@\"\n"
	if err := os.WriteFile(ssh, []byte(script), 0o755); err != nil {
		f.t.Fatal(err)
	}
	for name, d := range f.hosts {
		if err := os.WriteFile(filepath.Join(dir, name+".sock"), []byte(d.Socket), 0o644); err != nil {
			f.t.Fatal(err)
		}
	}
	cmd := exec.Command(filepath.Join(f.bin, "carrel"), append([]string{"--host", host}, args...)...)
	cmd.Env = append(os.Environ(), "CARREL_SSH="+ssh, "CARREL_SOCKET=/nonexistent/carrel.sock")
	out, err := cmd.CombinedOutput()
	if err != nil {
		f.t.Fatalf("carrel --host %s %v: %v\n%s", host, args, err, out)
	}
	return string(out)
}

// gracefulStop checks host's audit log records vm's graceful stop.
func (f *fleet) gracefulStop(host, vm string) {
	f.t.Helper()
	d := f.hosts[host]
	rec := d.Must("audit", "show", "--dir", filepath.Join(d.State, "audit"), vm, "--kind", "vm.lifecycle")
	if !strings.Contains(rec, "power off") {
		f.t.Errorf("%s's records on %s show no graceful stop:\n%s", vm, host, rec)
	}
}

func (f *fleet) uncordon(host string) {
	f.t.Helper()
	ctx := context.Background()
	n, err := f.cs.CoreV1().Nodes().Get(ctx, host, metav1.GetOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	n.Spec.Unschedulable = false
	if _, err := f.cs.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
		f.t.Fatal(err)
	}
}
