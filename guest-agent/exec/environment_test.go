package exec

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestReadEnvironment(t *testing.T) {
	p := filepath.Join(t.TempDir(), "environment")
	content := "# comment\n\nPATH=\"/home/agent/.local/bin:/usr/bin\"\nexport LANG=C.UTF-8\nEMPTY=\n1BAD=x\nno equals\nQ=\"a b\"\n"
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	env, err := ReadEnvironment(p)
	want := []string{"PATH=/home/agent/.local/bin:/usr/bin", "LANG=C.UTF-8", "EMPTY=", "Q=a b"}
	if !slices.Equal(env, want) {
		t.Errorf("env %q, want %q", env, want)
	}
	if err == nil || !strings.Contains(err.Error(), "lines 6, 7 skipped") {
		t.Errorf("err %v", err)
	}
	if env, err := ReadEnvironment(filepath.Join(t.TempDir(), "none")); env != nil || err != nil {
		t.Errorf("missing file: %v, %v", env, err)
	}
	if err := os.WriteFile(p, []byte(strings.Repeat("A=b\n", maxEnvironmentBytes)), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadEnvironment(p); err == nil {
		t.Error("an oversize file was read")
	}
}
