package controller

import (
	"encoding/json"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/carrel-os/carrel/supervisor/fleet/v1alpha1"
	"github.com/carrel-os/carrel/supervisor/internal/clocktest"
)

func newClock() *clocktest.Clock { return clocktest.New(time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)) }

// reportCondition is a host's report as it puts it in a run's pod.
func reportCondition(t *testing.T, rep v1alpha1.HostReport) corev1.PodCondition {
	t.Helper()
	b, err := json.Marshal(rep)
	if err != nil {
		t.Fatal(err)
	}
	return corev1.PodCondition{Type: v1alpha1.ConditionVM, Status: corev1.ConditionTrue, Message: string(b)}
}

func bound(node string, conds ...corev1.PodCondition) *corev1.Pod {
	return &corev1.Pod{Spec: corev1.PodSpec{NodeName: node}, Status: corev1.PodStatus{Conditions: conds}}
}

func TestMirrorUnscheduled(t *testing.T) {
	const why = "0/3 nodes are available: 3 Insufficient gpu.carrel.dev."
	p := bound("", corev1.PodCondition{Type: corev1.PodScheduled, Status: corev1.ConditionFalse, Message: why})
	st := &v1alpha1.AgentVMStatus{Phase: v1alpha1.PhasePending}
	mirror(p, st)
	if st.Phase != v1alpha1.PhasePending || st.Message != why {
		t.Errorf("phase %s, message %q; want Pending, %q", st.Phase, st.Message, why)
	}
}

func TestMirrorReports(t *testing.T) {
	audit := &v1alpha1.AuditCheckpoint{Origin: "host-a/audit", Size: 7, RootHash: "cm9vdA=="}
	gpus := []string{"0000:01:00.0"}
	for _, tc := range []struct {
		phase string
		want  v1alpha1.Phase
	}{
		{"Booting", v1alpha1.PhaseBooting},
		{"Running", v1alpha1.PhaseRunning},
		{"Stopping", v1alpha1.PhaseStopping},
		{"Gone", v1alpha1.PhaseStopping},
		{"Stopped", v1alpha1.PhaseStopped},
		{"Failed", v1alpha1.PhaseFailed},
	} {
		rep := v1alpha1.HostReport{Phase: tc.phase, Session: "s-1", GPUs: gpus, Reason: "Why", Audit: audit}
		st := &v1alpha1.AgentVMStatus{Phase: v1alpha1.PhaseScheduled}
		mirror(bound("host-a", reportCondition(t, rep)), st)
		if st.Phase != tc.want || st.Node != "host-a" || st.Session != "s-1" || !slices.Equal(st.GPUs, gpus) || st.AuditCheckpoint == nil || *st.AuditCheckpoint != *audit {
			t.Errorf("host reports %s: status %+v, want phase %s with the report's node, session, GPUs and checkpoint", tc.phase, st, tc.want)
		}
		ready := meta.IsStatusConditionTrue(st.Conditions, "Ready")
		if ready != (tc.want == v1alpha1.PhaseRunning) {
			t.Errorf("host reports %s: Ready %v", tc.phase, ready)
		}
		if tc.want == v1alpha1.PhaseFailed && st.Message != "Why" {
			t.Errorf("Failed without a message: message %q, want the reason", st.Message)
		}
	}
}

func TestMirrorBoundWithoutReport(t *testing.T) {
	for name, c := range map[string]corev1.PodCondition{
		"none":      {Type: corev1.PodReady, Status: corev1.ConditionFalse},
		"malformed": {Type: v1alpha1.ConditionVM, Status: corev1.ConditionTrue, Message: `{"phase": "Running"`},
		"oversized": reportCondition(t, v1alpha1.HostReport{Phase: "Running", Message: strings.Repeat("x", v1alpha1.MaxHostReport)}),
	} {
		st := &v1alpha1.AgentVMStatus{Phase: v1alpha1.PhasePending}
		mirror(bound("host-a", c), st)
		if st.Phase != v1alpha1.PhaseScheduled || st.Node != "host-a" {
			t.Errorf("report %s: phase %s on %q, want Scheduled on host-a", name, st.Phase, st.Node)
		}
	}
}

func TestMirrorDeleting(t *testing.T) {
	for rep, want := range map[string]v1alpha1.Phase{
		"Running": v1alpha1.PhaseStopping,
		"Stopped": v1alpha1.PhaseStopped, // over already
	} {
		p := bound("host-a", reportCondition(t, v1alpha1.HostReport{Phase: rep}))
		p.DeletionTimestamp = &metav1.Time{Time: time.Now()}
		st := &v1alpha1.AgentVMStatus{}
		mirror(p, st)
		if st.Phase != want {
			t.Errorf("pod being deleted, host reports %s: phase %s, want %s", rep, st.Phase, want)
		}
	}
}

func TestPodFor(t *testing.T) {
	mem := resource.MustParse("2Gi")
	avm := &v1alpha1.AgentVM{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "team"},
		Spec: v1alpha1.AgentVMSpec{Image: "base", CPUs: 2, Memory: &mem, Driver: "libvirt",
			GPUs: &v1alpha1.GPURequest{Count: 1}},
	}
	st := &v1alpha1.AgentVMStatus{Run: 3, Pod: "web-3", LostNodes: []string{"host-a", "host-b"}}
	p := PodFor(avm, st)

	if p.Name != "web-3" || p.Namespace != "team" || p.Labels[v1alpha1.LabelAgentVM] != "web" {
		t.Errorf("pod %s/%s labelled %v", p.Namespace, p.Name, p.Labels)
	}
	for _, want := range []corev1.Toleration{
		{Key: v1alpha1.TaintHost, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule},
		{Key: corev1.TaintNodeUnreachable, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute},
		{Key: corev1.TaintNodeNotReady, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute},
	} {
		if !slices.ContainsFunc(p.Spec.Tolerations, func(t corev1.Toleration) bool { return t.MatchToleration(&want) && t.TolerationSeconds == nil }) {
			t.Errorf("tolerations %+v lack %+v without a time limit", p.Spec.Tolerations, want)
		}
	}
	wantSel := map[string]string{v1alpha1.LabelAdmitted: "true", v1alpha1.LabelDriver: "libvirt"}
	if !maps.Equal(p.Spec.NodeSelector, wantSel) {
		t.Errorf("node selector %v, want %v", p.Spec.NodeSelector, wantSel)
	}

	if len(p.Spec.Containers) != 1 {
		t.Fatalf("%d containers, want 1", len(p.Spec.Containers))
	}
	c := p.Spec.Containers[0]
	claims := p.Spec.ResourceClaims
	if len(claims) != 1 || claims[0].Name != v1alpha1.GPUClaim || ptr.Deref(claims[0].ResourceClaimTemplateName, "") != "web-gpus" ||
		len(c.Resources.Claims) != 1 || c.Resources.Claims[0].Name != v1alpha1.GPUClaim {
		t.Errorf("pod claims %+v, container claims %+v: want the claim %q from template web-gpus", claims, c.Resources.Claims, v1alpha1.GPUClaim)
	}
	wantMem := int64(2<<30 + PodMemoryOverhead)
	for what, rl := range map[string]corev1.ResourceList{"requests": c.Resources.Requests, "limits": c.Resources.Limits} {
		if got := rl.Memory().Value(); got != wantMem {
			t.Errorf("memory %s %d, want %d", what, got, wantMem)
		}
		if got := rl.Cpu().Value(); got != 2 {
			t.Errorf("cpu %s %d, want 2", what, got)
		}
	}

	a := p.Spec.Affinity
	if a == nil || a.NodeAffinity == nil || a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution == nil {
		t.Fatalf("affinity %+v, want a required node affinity", a)
	}
	terms := a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms
	want := corev1.NodeSelectorRequirement{Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpNotIn, Values: st.LostNodes}
	if len(terms) != 1 || len(terms[0].MatchExpressions) != 1 || terms[0].MatchExpressions[0].Key != want.Key ||
		terms[0].MatchExpressions[0].Operator != want.Operator || !slices.Equal(terms[0].MatchExpressions[0].Values, want.Values) {
		t.Errorf("node selector terms %+v, want one expression %+v", terms, want)
	}
}

func TestPodForDefaults(t *testing.T) {
	avm := &v1alpha1.AgentVM{ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "team"}, Spec: v1alpha1.AgentVMSpec{Image: "base"}}
	p := PodFor(avm, &v1alpha1.AgentVMStatus{Run: 1, Pod: "web-1"})
	req := p.Spec.Containers[0].Resources.Requests
	if req.Memory().Value() != 1<<30+PodMemoryOverhead || req.Cpu().Value() != 1 {
		t.Errorf("requests %v, want 1 CPU and 1 GiB and the overhead", req)
	}
	if !maps.Equal(p.Spec.NodeSelector, map[string]string{v1alpha1.LabelAdmitted: "true"}) {
		t.Errorf("node selector %v, want the admitted hosts alone", p.Spec.NodeSelector)
	}
	if p.Spec.ResourceClaims != nil || p.Spec.Containers[0].Resources.Claims != nil || p.Spec.Affinity != nil {
		t.Errorf("claims %v, affinity %v: want none", p.Spec.ResourceClaims, p.Spec.Affinity)
	}
}

func lease(node string, renew time.Time) *coordinationv1.Lease {
	l := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: node, Namespace: "kube-node-lease"}}
	if !renew.IsZero() {
		l.Spec.RenewTime = &metav1.MicroTime{Time: renew}
	}
	return l
}

func TestLeasesObserve(t *testing.T) {
	ls := newLeases(newClock().Now)
	t1 := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	for i, tc := range []struct {
		l   *coordinationv1.Lease
		new bool
	}{
		{lease("host-a", time.Time{}), true},
		{lease("host-a", time.Time{}), false},
		{lease("host-a", t1), true},
		{lease("host-a", t1), false},
		{lease("host-a", t1.In(time.FixedZone("x", 3600))), false}, // the same instant
		{lease("host-b", t1), true},
		{lease("host-a", t1.Add(time.Microsecond)), true},
	} {
		if got := ls.observe(tc.l); got != tc.new {
			t.Errorf("%d: observe(%s renewed %v) = %v, want %v", i, tc.l.Name, tc.l.Spec.RenewTime, got, tc.new)
		}
	}
}

func TestLeasesSilent(t *testing.T) {
	clk := newClock()
	ls := newLeases(clk.Now)
	clk.Advance(time.Hour)
	if s := ls.silent("host-a"); s != 0 {
		t.Errorf("a host never seen: silent %s, want 0 from first sight", s)
	}
	clk.Advance(10 * time.Second)
	if s := ls.silent("host-a"); s != 10*time.Second {
		t.Errorf("silent %s, want 10s since first sight", s)
	}
	renew := clk.Now()
	ls.observe(lease("host-a", renew))
	clk.Advance(5 * time.Second)
	ls.observe(lease("host-a", renew)) // seen again, not renewed
	if s := ls.silent("host-a"); s != 5*time.Second {
		t.Errorf("silent %s, want 5s since the renewal", s)
	}
}
