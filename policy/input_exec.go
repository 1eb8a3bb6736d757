package policy

import (
	"fmt"
	"strings"

	"github.com/open-policy-agent/opa/v1/ast"
)

// ExecInput asks whether a command may start in a VM.
type ExecInput struct {
	Caller Caller            `json:"caller"`
	VM     string            `json:"vm"`
	Argv   []string          `json:"argv"`
	Env    map[string]string `json:"env"`
	Cwd    string            `json:"cwd"`
	User   string            `json:"user"`
	TTY    bool              `json:"tty"`
}

// Defaults the guest applies, filled in so that rules see what will run.
const (
	DefaultUser = "agent"
	DefaultCwd  = "/workspace"
)

func (*ExecInput) Kind() Kind        { return KindExec }
func (in *ExecInput) VMName() string { return in.VM }

func (in *ExecInput) Normalize() error {
	if err := normalizeCaller(in.Caller); err != nil {
		return err
	}
	if len(in.Argv) == 0 {
		return fmt.Errorf("%w: empty argv", ErrInvalidInput)
	}
	if len(in.Argv) > MaxArgs || len(in.Env) > MaxEnv {
		return fmt.Errorf("%w: %d arguments and %d environment variables, limits %d and %d", ErrInvalidInput, len(in.Argv), len(in.Env), MaxArgs, MaxEnv)
	}
	if in.User == "" {
		in.User = DefaultUser
	}
	if in.Cwd == "" {
		in.Cwd = DefaultCwd
	}
	cwd, err := CleanPath(in.Cwd)
	if err != nil {
		return err
	}
	in.Cwd = cwd
	total := 0
	for _, a := range in.Argv {
		total += len(a)
	}
	for k, v := range in.Env {
		total += len(k) + len(v)
		if k == "" || strings.ContainsRune(k, '=') {
			return fmt.Errorf("%w: environment name %q", ErrInvalidInput, k)
		}
		if err := checkStrings("env", k, v); err != nil {
			return err
		}
	}
	if total > MaxInputBytes {
		return fmt.Errorf("%w: %d bytes of arguments and environment, limit %d", ErrInvalidInput, total, MaxInputBytes)
	}
	if err := checkStrings("argv", in.Argv...); err != nil {
		return err
	}
	return checkStrings("exec", in.VM, in.User)
}

func (in *ExecInput) value() ast.Value {
	argv := make([]*ast.Term, len(in.Argv))
	for i, a := range in.Argv {
		argv[i] = ast.StringTerm(a)
	}
	env := make([][2]*ast.Term, 0, len(in.Env))
	for k, v := range in.Env {
		env = append(env, ast.Item(ast.StringTerm(k), ast.StringTerm(v)))
	}
	return ast.NewObject(
		ast.Item(keyVersion, versionTerm),
		ast.Item(keyCaller, ast.NewTerm(callerValue(in.Caller))),
		ast.Item(keyVM, ast.StringTerm(in.VM)),
		ast.Item(keyArgv, ast.ArrayTerm(argv...)),
		ast.Item(keyEnv, ast.NewTerm(ast.NewObject(env...))),
		ast.Item(keyCwd, stringTerm(in.Cwd)),
		ast.Item(keyUser, stringTerm(in.User)),
		ast.Item(keyTTY, ast.InternedTerm(in.TTY)),
	)
}
