package policy

import (
	"fmt"
	"strings"

	"github.com/open-policy-agent/opa/v1/ast"
)

// APIInput asks whether caller may call procedure (on vm, if it names one).
type APIInput struct {
	Caller    Caller `json:"caller"`
	DaemonUID uint32 `json:"daemon_uid"`
	Procedure string `json:"procedure"`
	VM        string `json:"vm"`
	// GPUs are the PCI addresses of the GPUs the call would give vm:
	// CreateVM's, or the ones a VM that StartVM boots was created with.
	// Normalize writes them in the kernel's spelling, sorted.
	GPUs []string `json:"gpus,omitempty"`
	// Image and VMPolicy, on CreateVM only, are the image the new VM
	// would boot and the policy it would be bound to ("" is "default").
	Image    string `json:"image,omitempty"`
	VMPolicy string `json:"vm_policy,omitempty"`
}

func (*APIInput) Kind() Kind        { return KindAPI }
func (in *APIInput) VMName() string { return in.VM }

func (in *APIInput) Normalize() error {
	if err := normalizeCaller(in.Caller); err != nil {
		return err
	}
	if !strings.HasPrefix(in.Procedure, "/") {
		return fmt.Errorf("%w: procedure %q", ErrInvalidInput, in.Procedure)
	}
	gpus, err := normalizeGPUs(in.GPUs)
	if err != nil {
		return err
	}
	in.GPUs = gpus
	return checkStrings("api", in.Procedure, in.VM, in.Image, in.VMPolicy)
}

func (in *APIInput) value() ast.Value {
	items := [][2]*ast.Term{
		ast.Item(keyVersion, versionTerm),
		ast.Item(keyCaller, ast.NewTerm(callerValue(in.Caller))),
		ast.Item(keyDaemonUID, ast.InternedTerm(in.DaemonUID)),
		ast.Item(keyProcedure, ast.StringTerm(in.Procedure)),
		ast.Item(keyVM, ast.StringTerm(in.VM)),
	}
	// As in the JSON: each of these only when set.
	if len(in.GPUs) > 0 {
		items = append(items, ast.Item(keyGPUs, stringsTerm(in.GPUs)))
	}
	if in.Image != "" {
		items = append(items, ast.Item(keyImage, ast.StringTerm(in.Image)))
	}
	if in.VMPolicy != "" {
		items = append(items, ast.Item(keyVMPolicy, ast.StringTerm(in.VMPolicy)))
	}
	return ast.NewObject(items...)
}
