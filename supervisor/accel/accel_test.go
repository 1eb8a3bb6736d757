package accel

import (
	"os"
	"path/filepath"
	"testing"
)

func TestDetect(t *testing.T) {
	dir := t.TempDir()
	kvm := filepath.Join(dir, "kvm")
	if err := os.WriteFile(kvm, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	write := func(name, flags string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte("processor\t: 0\nflags\t\t: "+flags+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	cases := []struct {
		name, kvm, cpuinfo, want string
	}{
		{"intel", kvm, write("vmx", "fpu sse2 vmx lm"), KVM},
		{"amd", kvm, write("svm", "fpu svm lm"), KVM},
		{"no flag", kvm, write("none", "fpu sse2 lm hypervisor"), TCG},
		{"no device", filepath.Join(dir, "missing"), write("vmx2", "vmx"), TCG},
		{"no cpuinfo", kvm, filepath.Join(dir, "nocpuinfo"), TCG},
	}
	for _, c := range cases {
		got := detect(c.kvm, c.cpuinfo)
		if got.Name != c.want {
			t.Errorf("%s: got %s (%s), want %s", c.name, got.Name, got.Reason, c.want)
		}
		if got.Reason == "" {
			t.Errorf("%s: empty reason", c.name)
		}
	}
}

func TestQEMUCPU(t *testing.T) {
	if got := QEMUCPU(KVM); got != "host" {
		t.Errorf("kvm: %q", got)
	}
	if got := QEMUCPU(TCG); got != "max,erms=off" {
		t.Errorf("tcg: %q", got)
	}
}
