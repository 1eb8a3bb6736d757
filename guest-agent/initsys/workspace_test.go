//go:build linux

package initsys

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestWorkspaceOnDisk(t *testing.T) {
	for cmdline, want := range map[string]bool{
		"console=ttyS0 carrel.workspace=disk carrel.workspace_bytes=33554432": true,
		"carrel.workspace=disk":                         true,
		"console=ttyS0 carrel.workspace_bytes=33554432": false,
		"carrel.workspace=disks carrel.workspace=":      false,
		"": false,
	} {
		if got := WorkspaceOnDisk(cmdline); got != want {
			t.Errorf("%q: %v, want %v", cmdline, got, want)
		}
	}
}

func TestFindDiskBySerial(t *testing.T) {
	sys := t.TempDir()
	mk := func(name, serial string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Join(sys, name), 0o755); err != nil {
			t.Fatal(err)
		}
		if serial != "" {
			if err := os.WriteFile(filepath.Join(sys, name, "serial"), []byte(serial+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	mk("loop0", "")
	mk("vda", "other-disk")
	if _, err := findDisk(sys, "carrel-workspace", 100*time.Millisecond); err == nil || !strings.Contains(err.Error(), "carrel-workspace") {
		t.Errorf("no such disk: %v", err)
	}
	// The disk appears while findDisk waits, as a driver's probe makes it.
	go func() {
		time.Sleep(100 * time.Millisecond)
		os.MkdirAll(filepath.Join(sys, "vdb"), 0o755)
		os.WriteFile(filepath.Join(sys, "vdb", "serial"), []byte("carrel-workspace\n"), 0o644)
	}()
	if name, err := findDisk(sys, "carrel-workspace", 5*time.Second); err != nil || name != "vdb" {
		t.Errorf("findDisk = %q, %v", name, err)
	}
}
