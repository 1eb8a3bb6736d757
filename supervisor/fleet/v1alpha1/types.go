package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// AgentVM is one agent computer: a carrel VM that Kubernetes' scheduler
// places on one of the fleet's hosts, with the GPUs it allocates. Each
// placement is a run, carried by one Pod; a run's VM is a new session
// booted from the image, so state never moves between hosts unseen.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=avm,categories=carrel
// +kubebuilder:printcolumn:name="Phase",type=string,JSONPath=`.status.phase`
// +kubebuilder:printcolumn:name="Node",type=string,JSONPath=`.status.node`
// +kubebuilder:printcolumn:name="Session",type=string,JSONPath=`.status.session`
// +kubebuilder:printcolumn:name="GPUs",type=string,JSONPath=`.status.gpus`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
// +kubebuilder:validation:XValidation:rule="self.metadata.name.matches('^[a-z][a-z0-9-]{0,62}$')",message="an AgentVM's name is its VM's name on its host: 1-63 lower-case letters, digits and '-', starting with a letter"
// +kubebuilder:validation:XValidation:rule="!self.metadata.name.startsWith('e2b-')",message="names starting e2b- are the e2b API keys' VMs on the hosts"
type AgentVM struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   AgentVMSpec   `json:"spec"`
	Status AgentVMStatus `json:"status,omitempty"`
}

// AgentVMSpec is what to boot. It cannot change once set, except for
// what the controller reads again at the next run (none of it).
//
// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="an AgentVM's spec cannot change: delete it and create another"
// +kubebuilder:validation:XValidation:rule="!has(self.memory) || quantity(string(self.memory)).compareTo(quantity('128Mi')) >= 0",message="memory must be at least 128Mi"
// +kubebuilder:validation:XValidation:rule="!has(self.workspace) || quantity(string(self.workspace)).compareTo(quantity('64Mi')) >= 0",message="workspace must be at least 64Mi"
type AgentVMSpec struct {
	// Image is the image's tag or digest on the hosts (carrel image ls).
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=256
	Image string `json:"image"`
	// CPUs is the VM's vCPU count, and the cores the scheduler counts.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=256
	// +kubebuilder:default=1
	// +optional
	CPUs int32 `json:"cpus,omitempty"`
	// Memory is the VM's memory (default 1Gi), and what the scheduler
	// counts.
	// +optional
	Memory *resource.Quantity `json:"memory,omitempty"`
	// Workspace is the size of the VM's workspace disk (the host's default
	// when unset).
	// +optional
	Workspace *resource.Quantity `json:"workspace,omitempty"`
	// GPUs are allocated by the scheduler from the hosts' ResourceSlices
	// and passed through with VFIO.
	// +optional
	GPUs *GPURequest `json:"gpus,omitempty"`
	// PolicyRef names the policy bound to the VM on its host (a Policy of
	// this namespace, once applied, or one the host has).
	// +kubebuilder:validation:MaxLength=63
	// +optional
	PolicyRef string `json:"policyRef,omitempty"`
	// Driver picks hosts whose carreld runs new VMs with it.
	// +kubebuilder:validation:Enum=qemu;libvirt
	// +optional
	Driver string `json:"driver,omitempty"`
	// DeadlineSeconds ends a run that long after its VM was created: the
	// VM is stopped and the AgentVM is Stopped.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=31536000
	// +optional
	DeadlineSeconds *int64 `json:"deadlineSeconds,omitempty"`
	// OnNodeLoss says what follows when the run's host is lost or
	// drained: Fail ends the AgentVM; Recreate starts a new run, a new
	// session from the image, on another host.
	// +kubebuilder:validation:Enum=Fail;Recreate
	// +kubebuilder:default=Fail
	// +optional
	OnNodeLoss NodeLossAction `json:"onNodeLoss,omitempty"`
}

// NodeLossAction is what follows the loss of a run's host.
type NodeLossAction string

const (
	NodeLossFail     NodeLossAction = "Fail"
	NodeLossRecreate NodeLossAction = "Recreate"
)

// GPURequest asks for GPUs of a device class.
type GPURequest struct {
	// Count is how many.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=16
	Count int32 `json:"count"`
	// DeviceClassName is the DeviceClass to allocate from (default
	// gpu.carrel.dev, every GPU the hosts publish).
	// +kubebuilder:validation:MaxLength=253
	// +optional
	DeviceClassName string `json:"deviceClassName,omitempty"`
	// Selectors are CEL expressions over a device's attributes, such as
	// device.attributes["gpu.carrel.dev"].model == "H100"; a device must
	// satisfy all.
	// +kubebuilder:validation:MaxItems=8
	// +optional
	Selectors []string `json:"selectors,omitempty"`
}

// Phase is where an AgentVM is.
type Phase string

const (
	PhasePending   Phase = "Pending"   // its run's pod waits for a host
	PhaseScheduled Phase = "Scheduled" // placed; its host has not booted it
	PhaseBooting   Phase = "Booting"   // its host is booting the VM
	PhaseRunning   Phase = "Running"   // the VM runs and its agent answers
	PhaseStopping  Phase = "Stopping"  // its host is stopping the VM
	PhaseStopped   Phase = "Stopped"   // the run ended; no new one follows
	PhaseFailed    Phase = "Failed"    // the run failed; no new one follows
	PhaseLost      Phase = "Lost"      // its host went silent; the VM is fenced there
)

// AgentVMStatus is what the controller has seen of the AgentVM's runs.
type AgentVMStatus struct {
	// Phase is the current run's phase.
	// +optional
	Phase Phase `json:"phase,omitempty"`
	// Run counts the runs: the current run's pod is <name>-<run>.
	// +optional
	Run int32 `json:"run,omitempty"`
	// Pod is the current run's pod, and PodUID its UID once made: its
	// host runs that pod alone.
	// +optional
	Pod string `json:"pod,omitempty"`
	// +optional
	PodUID types.UID `json:"podUID,omitempty"`
	// Node is the host the current run was placed on.
	// +optional
	Node string `json:"node,omitempty"`
	// Session is the VM's session there: its records in that host's
	// audit log carry it.
	// +optional
	Session string `json:"session,omitempty"`
	// GPUs are the PCI addresses of the GPUs the run was given.
	// +optional
	GPUs []string `json:"gpus,omitempty"`
	// AuditCheckpoint is the latest checkpoint of the host's audit log
	// the host reported: which log to fetch, and what it must verify to.
	// +optional
	AuditCheckpoint *AuditCheckpoint `json:"auditCheckpoint,omitempty"`
	// LostNodes are the hosts earlier runs were lost on; new runs are
	// kept off them.
	// +optional
	LostNodes []string `json:"lostNodes,omitempty"`
	// Message says why, for Failed, Stopped and Lost.
	// +optional
	Message string `json:"message,omitempty"`
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
	// +listType=map
	// +listMapKey=type
	// +optional
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// AuditCheckpoint names a signed checkpoint of a host's audit log.
type AuditCheckpoint struct {
	// Origin is the log's name, its checkpoints' first line.
	Origin string `json:"origin"`
	// Size is the number of records it commits to.
	Size uint64 `json:"size"`
	// RootHash is the Merkle root over them, base64.
	RootHash string `json:"rootHash"`
}

// AgentVMList is a list of AgentVMs.
//
// +kubebuilder:object:root=true
type AgentVMList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []AgentVM `json:"items"`
}

// Policy is a Rego bundle, as carrel policy apply takes. An AgentVM
// whose policyRef names a Policy of its namespace is bound, on its host,
// to that bundle: the host applies it before it boots the VM, under a
// name of its own (HostPolicyName), so no Policy can replace a policy the
// host's operator installed.
//
// +kubebuilder:object:root=true
// +kubebuilder:resource:categories=carrel
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
// +kubebuilder:validation:XValidation:rule="self.metadata.name.matches('^[a-z][a-z0-9-]{0,62}$')",message="a Policy's name: 1-63 lower-case letters, digits and '-', starting with a letter"
type Policy struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec PolicySpec `json:"spec"`
}

// PolicySpec is the bundle: its files by name.
type PolicySpec struct {
	// Files are the bundle's .rego files and its data.json, by relative
	// path, as carrel policy apply takes a directory's.
	// +kubebuilder:validation:MinProperties=1
	// +kubebuilder:validation:MaxProperties=64
	Files map[string]string `json:"files"`
}

// PolicyList is a list of Policies.
//
// +kubebuilder:object:root=true
type PolicyList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []Policy `json:"items"`
}
