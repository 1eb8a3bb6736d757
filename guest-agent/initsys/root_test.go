//go:build linux

package initsys

import (
	"errors"
	"strings"
	"testing"
)

const (
	testHash = "cdcb1b5f3494aa00112233445566778899aabbccddeeff00112233445566aaff"
	testRoot = "console=ttyS0 panic=-1 roothash=" + testHash +
		" systemd.verity_root_data=/dev/disk/by-id/virtio-carrel-system" +
		" systemd.verity_root_hash=/dev/disk/by-id/virtio-carrel-system-verity"
)

func TestParseRoot(t *testing.T) {
	r, ok, err := ParseRoot(testRoot + " carrel.state=disk")
	if err != nil || !ok {
		t.Fatalf("ParseRoot = %v, %v", ok, err)
	}
	if len(r.Hash) != 32 || r.Hash[0] != 0xcd || r.Hash[31] != 0xff || r.DataSerial != "carrel-system" ||
		r.HashSerial != "carrel-system-verity" || r.State != "disk" || r.Init != "" {
		t.Errorf("root %+v", r)
	}
	// init= is kept.
	r, ok, err = ParseRoot(testRoot + " carrel.state=memory init=/lib/systemd/systemd")
	if err != nil || !ok || r.State != "memory" || r.Init != "/lib/systemd/systemd" {
		t.Errorf("root %+v, %v, %v", r, ok, err)
	}
	// No roothash: the initramfs is the root.
	if _, ok, err := ParseRoot("console=ttyS0 quiet panic=-1 carrel.workspace=disk"); ok || err != nil {
		t.Errorf("no root: %v, %v", ok, err)
	}
}

func TestParseRootRejects(t *testing.T) {
	for name, cmdline := range map[string]string{
		"short hash":     "roothash=abcd",
		"twice state":    testRoot + " carrel.state=disk carrel.state=memory",
		"upper hash":     strings.Replace(testRoot, testHash, strings.ToUpper(testHash), 1),
		"not hex":        strings.Replace(testRoot, testHash, strings.Repeat("zz", 32), 1),
		"twice":          testRoot + " roothash=" + testHash,
		"no data":        "roothash=" + testHash + " systemd.verity_root_hash=/dev/disk/by-id/virtio-h",
		"no hash device": "roothash=" + testHash + " systemd.verity_root_data=/dev/disk/by-id/virtio-d",
		"device by path": "roothash=" + testHash + " systemd.verity_root_data=/dev/vda systemd.verity_root_hash=/dev/disk/by-id/virtio-h",
		"long serial":    strings.Replace(testRoot, "carrel-system-verity", "carrel-system-verity-x", 1),
		"devices only":   "systemd.verity_root_data=/dev/disk/by-id/virtio-d",
		"bad state":      testRoot + " carrel.state=cloud",
		"relative init":  testRoot + " init=sbin/init",
		"unclean init":   testRoot + " init=/sbin/../init",
		"usrhash":        "usrhash=" + testHash,
		"no state":       testRoot,
	} {
		if _, _, err := ParseRoot(cmdline); !errors.Is(err, ErrRoot) {
			t.Errorf("%s: ParseRoot(%q) = %v, want ErrRoot", name, cmdline, err)
		}
	}
}

// FuzzParseRoot: whatever the command line, ParseRoot either errs or gives
// a root whose parts hold what the agent relies on.
func FuzzParseRoot(f *testing.F) {
	f.Add(testRoot + " carrel.state=memory")
	f.Add(testRoot + " carrel.state=disk init=/sbin/init")
	f.Add("console=ttyS0 roothash=")
	f.Fuzz(func(t *testing.T, cmdline string) {
		r, ok, err := ParseRoot(cmdline)
		if err != nil || !ok {
			return
		}
		if len(r.Hash) != 32 || r.DataSerial == "" || r.HashSerial == "" || len(r.DataSerial) > 20 || len(r.HashSerial) > 20 {
			t.Fatalf("ParseRoot(%q) = %+v", cmdline, r)
		}
		if r.State != "disk" && r.State != "memory" {
			t.Fatalf("state %q", r.State)
		}
		if r.Init != "" && !strings.HasPrefix(r.Init, "/") {
			t.Fatalf("init %q", r.Init)
		}
	})
}

func TestStateOf(t *testing.T) {
	for _, c := range []struct{ cmdline, want, err string }{
		{"init=/nix/store/x/init carrel.state=disk", "disk", ""},
		{"carrel.state=memory quiet", "memory", ""},
		{"init=/nix/store/x/init usrhash=00", "", "is missing"},
		{"carrel.state=disk carrel.state=memory", "", "twice"},
		{"carrel.state=tmpfs", "", "want disk or memory"},
	} {
		got, err := StateOf(c.cmdline)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("StateOf(%q) = %q, %v; want an error saying %q", c.cmdline, got, err, c.err)
			}
			continue
		}
		if err != nil || got != c.want {
			t.Errorf("StateOf(%q) = %q, %v; want %q", c.cmdline, got, err, c.want)
		}
	}
}
