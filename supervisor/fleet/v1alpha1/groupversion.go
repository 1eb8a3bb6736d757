// Package v1alpha1 is carrel's Kubernetes API, group carrel.dev: an
// AgentVM is one agent computer placed on one of the fleet's hosts by
// Kubernetes' scheduler, and a Policy is a Rego bundle its hosts apply.
//
// +kubebuilder:object:generate=true
// +groupName=carrel.dev
package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// GroupVersion is the API's group and version.
var GroupVersion = schema.GroupVersion{Group: "carrel.dev", Version: "v1alpha1"}

// AddToScheme registers the API's kinds.
func AddToScheme(s *runtime.Scheme) error {
	s.AddKnownTypes(GroupVersion, &AgentVM{}, &AgentVMList{}, &Policy{}, &PolicyList{})
	metav1.AddToGroupVersion(s, GroupVersion)
	return nil
}
