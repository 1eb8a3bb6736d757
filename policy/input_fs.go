package policy

import (
	"fmt"

	"github.com/open-policy-agent/opa/v1/ast"
)

// File operations, as the fs package sees them.
const (
	OpRead   = "read"
	OpWrite  = "write"
	OpCreate = "create"
	OpDelete = "delete"
	OpChmod  = "chmod"
	OpList   = "list"
	OpWatch  = "watch"
)

var fsOps = map[string]bool{OpRead: true, OpWrite: true, OpCreate: true, OpDelete: true, OpChmod: true, OpList: true, OpWatch: true}

// FSInput asks whether an operation on a path in a VM may go ahead.
type FSInput struct {
	Caller    Caller `json:"caller"`
	VM        string `json:"vm"`
	Operation string `json:"operation"`
	Path      string `json:"path"`
	Recursive bool   `json:"recursive"`
}

func (*FSInput) Kind() Kind        { return KindFS }
func (in *FSInput) VMName() string { return in.VM }

func (in *FSInput) Normalize() error {
	if err := normalizeCaller(in.Caller); err != nil {
		return err
	}
	if !fsOps[in.Operation] {
		return fmt.Errorf("%w: file operation %q", ErrInvalidInput, in.Operation)
	}
	p, err := CleanPath(in.Path)
	if err != nil {
		return err
	}
	in.Path = p
	return checkStrings("fs", in.VM)
}

func (in *FSInput) value() ast.Value {
	return ast.NewObject(
		ast.Item(keyVersion, versionTerm),
		ast.Item(keyCaller, ast.NewTerm(callerValue(in.Caller))),
		ast.Item(keyVM, ast.StringTerm(in.VM)),
		ast.Item(keyOperation, stringTerm(in.Operation)),
		ast.Item(keyPath, ast.StringTerm(in.Path)),
		ast.Item(keyRecursive, ast.InternedTerm(in.Recursive)),
	)
}
