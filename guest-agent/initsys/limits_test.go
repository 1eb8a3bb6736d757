package initsys

import (
	"strings"
	"testing"
)

func TestParseLimits(t *testing.T) {
	l, err := ParseLimits("console=ttyS0 quiet carrel.workspace_bytes=268435456 carrel.max_processes=512 panic=-1")
	if err != nil || l.WorkspaceBytes != 256<<20 || l.MaxProcesses != 512 {
		t.Errorf("got %+v, %v", l, err)
	}
	if l, err := ParseLimits("console=ttyS0"); err != nil || l != (Limits{}) {
		t.Errorf("no limits: %+v, %v", l, err)
	}
	l, err = ParseLimits("carrel.workspace_bytes=12 carrel.max_processes=64 carrel.max_processes=x")
	if err == nil || !strings.Contains(err.Error(), "workspace_bytes") || !strings.Contains(err.Error(), `"x"`) || l.WorkspaceBytes != 0 || l.MaxProcesses != 64 {
		t.Errorf("bad values: %+v, %v", l, err)
	}
}

func FuzzParseLimits(f *testing.F) {
	f.Add("carrel.workspace_bytes=268435456 carrel.max_processes=512")
	f.Add("carrel.max_processes=99999999999999999999999")
	f.Fuzz(func(t *testing.T, s string) {
		l, _ := ParseLimits(s)
		if l.WorkspaceBytes != 0 && (l.WorkspaceBytes < MinWorkspaceBytes || l.WorkspaceBytes > MaxWorkspaceBytes) {
			t.Fatalf("workspace %d out of bounds", l.WorkspaceBytes)
		}
		if l.MaxProcesses != 0 && (l.MaxProcesses < MinProcesses || l.MaxProcesses > MaxProcesses) {
			t.Fatalf("processes %d out of bounds", l.MaxProcesses)
		}
	})
}
