package policy

import (
	"fmt"

	"github.com/open-policy-agent/opa/v1/ast"
)

// GuestInput asks whether the agent inside a VM may have what it asked
// its host for.
type GuestInput struct {
	VM      string            `json:"vm"`
	Request string            `json:"request"`
	Args    map[string]string `json:"args"`
}

func (*GuestInput) Kind() Kind        { return KindGuest }
func (in *GuestInput) VMName() string { return in.VM }

func (in *GuestInput) Normalize() error {
	if in.Request == "" {
		return fmt.Errorf("%w: empty guest request", ErrInvalidInput)
	}
	if len(in.Args) > 64 {
		return fmt.Errorf("%w: %d guest request arguments, limit 64", ErrInvalidInput, len(in.Args))
	}
	for k, v := range in.Args {
		if err := checkStrings("guest", k, v); err != nil {
			return err
		}
	}
	return checkStrings("guest", in.VM, in.Request)
}

func (in *GuestInput) value() ast.Value {
	args := make([][2]*ast.Term, 0, len(in.Args))
	for k, v := range in.Args {
		args = append(args, ast.Item(ast.StringTerm(k), ast.StringTerm(v)))
	}
	return ast.NewObject(
		ast.Item(keyVersion, versionTerm),
		ast.Item(keyVM, ast.StringTerm(in.VM)),
		ast.Item(keyRequest, ast.StringTerm(in.Request)),
		ast.Item(keyArgs, ast.NewTerm(ast.NewObject(args...))),
	)
}
