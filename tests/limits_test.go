package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/carrel-os/carrel/image/workspace"
	"github.com/carrel-os/carrel/tests/harness"
)

// TestGuestLimits: a VM's workspace size and process limit hold inside the
// guest, and out-of-range limits are refused before anything starts. The
// workspace is a copy-on-write disk over the image's template, kept across
// a stop; an image without a template gives a tmpfs of the same size.
func TestGuestLimits(t *testing.T) {
	d := harness.New(t)
	d.Start()
	d.BuildImage()
	if r := d.Carrel("vm", "create", "tiny", "--workspace", "1M"); r.Code == 0 || !strings.Contains(r.Stderr, "workspace") {
		t.Fatalf("a 1 MiB workspace: %+v", r)
	}
	if r := d.Carrel("vm", "create", "tiny", "--max-processes", "3"); r.Code == 0 || !strings.Contains(r.Stderr, "processes") {
		t.Fatalf("3 processes: %+v", r)
	}
	d.Must("vm", "create", "lim", "--memory", "256M", "--workspace", "32M", "--max-processes", "40")

	// On the host: a 32 MiB qcow2 disk whose backing file is the image's
	// template.
	dev, err := openStore(t, d).Resolve("dev")
	if err != nil || dev.WorkspacePath == "" {
		t.Fatalf("the dev image has no workspace template: %+v, %v", dev, err)
	}
	disk := filepath.Join(d.State, "vms", "lim", "workspace.qcow2")
	if i, err := workspace.Inspect(context.Background(), "qemu-img", disk); err != nil || i.Format != "qcow2" ||
		i.VirtualSize != 32<<20 || i.BackingFilename != dev.WorkspacePath || i.BackingFormat != "raw" {
		t.Errorf("workspace disk: %+v, %v", i, err)
	}
	// In the guest: that disk, ext4, grown from the template's 16 MiB to
	// the disk's 32 MiB (less the file system's own blocks).
	if out := d.Must("exec", "lim", "--", "sh", "-c", `m=$(grep ' /workspace ' /proc/mounts); echo "$m"; b=${m%% *}; b=${b#/dev/}; echo $(cat /sys/block/$b/serial) $(cat /sys/block/$b/size)`); !strings.HasPrefix(out, "/dev/vd") || !strings.Contains(out, " /workspace ext4 rw,nosuid,nodev") || !strings.HasSuffix(out, "\ncarrel-workspace 65536\n") {
		t.Errorf("workspace mount and disk: %q", out)
	}
	if kb := workspaceKB(t, d, "lim"); kb < 24<<10 || kb > 32<<10 {
		t.Errorf("workspace file system: %d KiB, want 24 to 32 MiB", kb)
	}
	if out := d.Must("exec", "lim", "--", "ls", "-a", "/workspace"); out != ".\n..\n" {
		t.Errorf("a new workspace holds %q", out)
	}
	r := d.Carrel("exec", "lim", "--", "dd", "if=/dev/zero", "of=/workspace/fill", "bs=1M", "count=64")
	if r.Code == 0 || !strings.Contains(r.Stderr, "No space left") {
		t.Errorf("writing 64 MiB into a 32 MiB workspace: %+v", r)
	}
	d.Must("exec", "lim", "--", "sh", "-c", "rm /workspace/fill && echo kept > /workspace/note")
	if out := d.Must("exec", "lim", "--", "cat", "/sys/fs/cgroup/carrel/pids.max"); strings.TrimSpace(out) != "40" {
		t.Errorf("pids.max %q", out)
	}
	// 60 background sleeps from one command: the 41st process cannot fork.
	r = d.Carrel("exec", "lim", "--", "sh", "-c", "i=0; while [ $i -lt 60 ]; do sleep 30 & i=$((i+1)); done; echo started all")
	if r.Code == 0 || strings.Contains(r.Stdout, "started all") || !strings.Contains(strings.ToLower(r.Stderr), "fork") {
		t.Errorf("60 processes under a limit of 40: %+v", r)
	}
	// The agent user cannot lift the limit.
	if r := d.Carrel("exec", "lim", "--", "sh", "-c", "echo max > /sys/fs/cgroup/carrel/pids.max"); r.Code == 0 {
		t.Errorf("the agent user raised pids.max: %+v", r)
	}
	var vm struct {
		WorkspaceBytes string `json:"workspaceBytes"`
		MaxProcesses   string `json:"maxProcesses"`
	}
	if err := json.Unmarshal([]byte(d.Must("vm", "inspect", "lim")), &vm); err != nil || vm.WorkspaceBytes != "33554432" || vm.MaxProcesses != "40" {
		t.Errorf("vm inspect: %+v, %v", vm, err)
	}

	// The workspace outlives a stop.
	d.Must("vm", "stop", "lim")
	d.Must("vm", "start", "lim")
	if out := d.Must("exec", "lim", "--", "cat", "/workspace/note"); out != "kept\n" {
		t.Errorf("after stop and start: %q", out)
	}
	d.Must("vm", "rm", "--force", "lim")

	// The fallback: an image without a workspace template gives a tmpfs,
	// sized in the guest.
	st := openStore(t, d)
	m := *dev.Manifest
	m.Workspace = nil
	digest, err := st.PutManifest(&m)
	if err != nil {
		t.Fatal(err)
	}
	d.Must("vm", "create", "mem", "--image", digest, "--memory", "256M", "--workspace", "32M")
	if out := d.Must("exec", "mem", "--", "grep", " /workspace ", "/proc/mounts"); !strings.HasPrefix(out, "workspace /workspace tmpfs ") {
		t.Errorf("workspace of an image without a template: %q", out)
	}
	if kb := workspaceKB(t, d, "mem"); kb != 32<<10 {
		t.Errorf("tmpfs workspace: %d KiB, want 32 MiB", kb)
	}
	if _, err := os.Stat(filepath.Join(d.State, "vms", "mem", "workspace.qcow2")); !os.IsNotExist(err) {
		t.Errorf("a workspace disk for an image without a template: %v", err)
	}
	d.Must("vm", "rm", "--force", "mem")
}

// workspaceKB is the size of vm's /workspace, in df's 1K-blocks.
func workspaceKB(t *testing.T, d *harness.Daemon, vm string) int {
	t.Helper()
	out := d.Must("exec", vm, "--", "df", "-k", "/workspace")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	var kb int
	if len(lines) != 2 || len(strings.Fields(lines[1])) < 2 {
		t.Fatalf("df: %q", out)
	}
	if _, err := fmt.Sscan(strings.Fields(lines[1])[1], &kb); err != nil {
		t.Fatalf("df: %q: %v", out, err)
	}
	return kb
}
