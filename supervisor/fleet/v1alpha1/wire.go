package v1alpha1

import (
	"crypto/sha256"
	"encoding/hex"
)

// HostPolicyName is the name a host applies a Policy under: "k8s-", a
// hash of its namespace and name, and as much of its name as fits. It
// cannot be a policy the host's operator named (they do not start so by
// convention), and Policies of two namespaces do not meet.
func HostPolicyName(namespace, name string) string {
	h := sha256.Sum256([]byte(namespace + "/" + name))
	out := "k8s-" + hex.EncodeToString(h[:4]) + "-" + name
	if len(out) > 63 {
		out = out[:63]
	}
	for len(out) > 0 && out[len(out)-1] == '-' {
		out = out[:len(out)-1]
	}
	return out
}

// What the controller and the hosts' carreld agree on, besides the
// kinds: the names on the pods, nodes and slices they share.
const (
	// LabelHost marks a carreld host's Node; TaintHost keeps every pod
	// but an AgentVM's run off it.
	LabelHost = "carrel.dev/host"
	TaintHost = "carrel.dev/host"
	// LabelDriver is a host's VM driver (qemu or libvirt): AgentVMs that
	// name one are placed by it.
	LabelDriver = "carrel.dev/driver"
	// LabelAdmitted marks a host an administrator admitted to the fleet:
	// runs are placed only there. A node cannot set labels under
	// node-restriction.kubernetes.io/ on itself (NodeRestriction).
	LabelAdmitted = "node-restriction.kubernetes.io/carrel-host"
	// RunFinalizer holds a run's pod until its host has stopped and
	// deleted the VM (or the host is lost).
	RunFinalizer = "carrel.dev/run"
	// LabelAgentVM names a run's pod's AgentVM.
	LabelAgentVM = "carrel.dev/agentvm"
	// GPUDriver is the DRA driver name the hosts publish GPUs under, and
	// the default DeviceClass's name.
	GPUDriver = "gpu.carrel.dev"
	// GPUClaim is the name of a run's pod's GPU claim.
	GPUClaim = "gpus"
	// ConditionVM is the pod condition a host reports its run in: its
	// message is a HostReport in JSON.
	ConditionVM = "carrel.dev/VM"
	// MaxHostReport caps a HostReport's JSON.
	MaxHostReport = 8 << 10
	// PodImage is the image a run's pod names: no kubelet runs it, and
	// no registry is asked for it.
	PodImage = "carrel.dev/agentvm"
)

// HostReport is what a host reports of a run, in its pod's ConditionVM.
type HostReport struct {
	// Phase is the host's: Booting, Running, Stopping, Stopped or Failed.
	Phase   string           `json:"phase"`
	Session string           `json:"session,omitempty"`
	GPUs    []string         `json:"gpus,omitempty"`
	Reason  string           `json:"reason,omitempty"`
	Message string           `json:"message,omitempty"`
	Audit   *AuditCheckpoint `json:"audit,omitempty"`
}
