package policy

import (
	"bytes"
	"strings"
	"testing"

	"github.com/open-policy-agent/opa/v1/ast"
	"github.com/open-policy-agent/opa/v1/format"
)

// TestBuiltinsAreFormatted keeps every shipped .rego file in opa fmt's
// canonical form, so that diffs of policies stay about meaning.
func TestBuiltinsAreFormatted(t *testing.T) {
	for _, name := range BuiltinNames() {
		b, err := Builtin(name)
		if err != nil {
			t.Fatal(err)
		}
		for p, src := range b.Files {
			if !strings.HasSuffix(p, ".rego") {
				continue
			}
			got, err := format.SourceWithOpts(p, src, format.Opts{RegoVersion: ast.RegoV1})
			if err != nil {
				t.Fatalf("%s: %s: %v", name, p, err)
			}
			if !bytes.Equal(got, src) {
				t.Errorf("%s: %s is not in opa fmt's form; it should read:\n%s", name, p, got)
			}
		}
	}
}
