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
	return checkStrings("api", in.Procedure, in.VM)
}

func (in *APIInput) value() ast.Value {
	caller := ast.NewTerm(callerValue(in.Caller))
	if len(in.GPUs) == 0 { // as in the JSON: gpus only when set
		return ast.NewObject(
			ast.Item(keyVersion, versionTerm),
			ast.Item(keyCaller, caller),
			ast.Item(keyDaemonUID, ast.InternedTerm(in.DaemonUID)),
			ast.Item(keyProcedure, ast.StringTerm(in.Procedure)),
			ast.Item(keyVM, ast.StringTerm(in.VM)),
		)
	}
	gpus := make([]*ast.Term, len(in.GPUs))
	for i, g := range in.GPUs {
		gpus[i] = ast.StringTerm(g)
	}
	return ast.NewObject(
		ast.Item(keyVersion, versionTerm),
		ast.Item(keyCaller, caller),
		ast.Item(keyDaemonUID, ast.InternedTerm(in.DaemonUID)),
		ast.Item(keyProcedure, ast.StringTerm(in.Procedure)),
		ast.Item(keyVM, ast.StringTerm(in.VM)),
		ast.Item(keyGPUs, ast.ArrayTerm(gpus...)),
	)
}
