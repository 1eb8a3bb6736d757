package main

import (
	"os/exec"
	"strings"
	"testing"
)

// heavyDeps are packages the CLI must not link: each one's package
// initialisation runs at every start of every command, used or not
// (issue 16: a CLI that does not evaluate policies must not pay for OPA).
// Policies are evaluated by carreld, or locally by carrel-policy.
var heavyDeps = []string{
	"github.com/open-policy-agent/opa/",
	"k8s.io/",
	"sigs.k8s.io/",
}

// TestNoHeavyDeps fails when a change makes the CLI link one of
// heavyDeps again, and names the import chain to cut.
func TestNoHeavyDeps(t *testing.T) {
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go tool on PATH to list the CLI's dependencies")
	}
	out, err := exec.Command(gobin, "list", "-deps", "-f", "{{.ImportPath}}: {{join .Imports \" \"}}", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	imports := map[string][]string{} // package -> what it imports
	var order []string               // go list's order: dependencies first, the CLI last
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		pkg, imps, _ := strings.Cut(line, ": ")
		imports[pkg] = strings.Fields(imps)
		order = append(order, pkg)
	}
	cli := order[len(order)-1]
	// Breadth first from the CLI: the first heavy package reached, and
	// the chain of imports that reaches it, which says what to cut.
	from := map[string]string{cli: ""}
	for queue := []string{cli}; len(queue) > 0; queue = queue[1:] {
		cur := queue[0]
		if isHeavy(cur) {
			chain := []string{cur}
			for p := from[cur]; p != ""; p = from[p] {
				chain = append(chain, p)
			}
			t.Fatalf("the CLI links %s, through %s", cur, strings.Join(chain[1:], " <- "))
		}
		for _, imp := range imports[cur] {
			if _, seen := from[imp]; !seen {
				from[imp] = cur
				queue = append(queue, imp)
			}
		}
	}
}

func isHeavy(pkg string) bool {
	for _, h := range heavyDeps {
		if strings.HasPrefix(pkg, h) {
			return true
		}
	}
	return false
}
