package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/supervisor/api"
	"github.com/carrel-os/carrel/supervisor/gpu"
	"github.com/carrel-os/carrel/supervisor/gpu/gputest"
)

// gpuServer serves carreld's API (without policy) on a fake sysfs tree.
func gpuServer(t *testing.T) string {
	t.Helper()
	t.Log("fake sysfs tree: real VFIO passthrough is not exercised here")
	s := gputest.New(t, gputest.Drivers...)
	s.Add(gputest.NVIDIAWithAudio()...)
	s.Add(gputest.AMDSharingNIC()...)
	s.Add(gputest.IntelIntegrated()...)
	h := api.Handler(api.Config{GPUs: gpu.New(gpu.Config{Sysfs: s.Root, Write: s.Write, PCIIDs: []string{gputest.PCIIDs(t)}})})
	sock := filepath.Join(t.TempDir(), "api.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- api.Serve(ctx, l, h) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return sock
}

func runCLI(t *testing.T, args ...string) string {
	t.Helper()
	root := newRootCmd()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetArgs(args)
	if err := root.ExecuteContext(context.Background()); err != nil {
		t.Fatalf("carrel %s: %v", strings.Join(args, " "), err)
	}
	return out.String()
}

func TestGPUList(t *testing.T) {
	sock := gpuServer(t)
	out := runCLI(t, "--socket", sock, "gpu", "ls")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 4 {
		t.Fatalf("gpu ls:\n%s", out)
	}
	for _, want := range [][]string{
		{"ADDRESS", "NAME", "IOMMU GROUP", "DRIVER", "VM", "ASSIGNABLE"},
		{"0000:00:02.0", "Intel Corporation [8086:9a49]", "2", "i915", "-", "yes (the host's boot display"},
		{"0000:01:00.0", "NVIDIA Corporation GA102 [GeForce RTX 3090] [10de:2204]", "1", "nvidia", "-", "yes"},
		{"0000:03:00.0", "[1002:73bf]", "8", "amdgpu", "no: IOMMU group 8 also holds 0000:04:00.0"},
	} {
		line := lines[0]
		for _, l := range lines {
			if strings.HasPrefix(l, want[0]) {
				line = l
			}
		}
		for _, field := range want {
			if !strings.Contains(line, field) {
				t.Errorf("line %q lacks %q", line, field)
			}
		}
	}

	var doc struct {
		Iommu bool `json:"iommu"`
		Gpus  []struct {
			Address    string `json:"address"`
			IommuGroup int    `json:"iommuGroup"`
			Assignable bool   `json:"assignable"`
			Group      []struct {
				Address string `json:"address"`
				Role    string `json:"role"`
			} `json:"group"`
		} `json:"gpus"`
	}
	if err := json.Unmarshal([]byte(runCLI(t, "--socket", sock, "gpu", "ls", "--output", "json")), &doc); err != nil {
		t.Fatal(err)
	}
	if !doc.Iommu || len(doc.Gpus) != 3 || doc.Gpus[1].Address != "0000:01:00.0" || doc.Gpus[1].IommuGroup != 1 || !doc.Gpus[1].Assignable ||
		len(doc.Gpus[1].Group) != 2 || doc.Gpus[1].Group[1].Role != "passed" {
		t.Errorf("gpu ls --output json: %+v", doc)
	}
}

func TestGPUAddresses(t *testing.T) {
	got := gpuAddresses([]string{"41:00.0", "0000:41:00.1", "10000:e1:00.0", "nonsense"})
	want := []string{"0000:41:00.0", "0000:41:00.1", "10000:e1:00.0", "nonsense"} // carreld refuses the last
	if !reflect.DeepEqual(got, want) {
		t.Errorf("gpuAddresses = %v, want %v", got, want)
	}
}
