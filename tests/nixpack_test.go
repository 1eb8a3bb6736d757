package tests

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/image/debian"
	"github.com/carrel-os/carrel/image/imagedir"
	"github.com/carrel-os/carrel/image/manifest"
	"github.com/carrel-os/carrel/tests/harness"
)

// TestNixImagePack runs the NixOS agent image's build step,
// nix/pack-image.sh, as its derivation (nix/modules/guest-image.nix) runs
// it, on real parts: the Debian builder's kernel, initramfs and erofs
// (the systemd-init image), arranged as the derivation arranges a NixOS
// system's, with a closure's store-path list. It checks the result, then
// shows what an operator of a NixOS host sees: carreld --import-image
// (services.carreld.images) imports it at start and again changes
// nothing; imports of a gone result link, an unfinished build and a
// manifest whose root hash disagrees with the tree fail clearly and leave
// the store as it was; and the image boots, with systemd as init and
// carrel-agent as its service. In it, carrel-agent --mount-state, run by
// systemd as the NixOS initrd runs it, puts the writable layer on the
// state disk.
func TestNixImagePack(t *testing.T) {
	b := harness.New(t)
	b.Start()
	buildSystemdImage(t, b)
	src := exportImage(t, openStore(t, b), "sysd")
	b.Stop()
	srcDir, err := imagedir.Read(src)
	if err != nil {
		t.Fatal(err)
	}
	sm := srcDir.Manifest

	// The derivation's inputs, each in a store path of its own.
	store := t.TempDir()
	storePath := func(name string) string {
		p := filepath.Join(store, fmt.Sprintf("%032d-%s", len(name), name))
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		return p
	}
	kernelFile := filepath.Join(storePath("linux-"+sm.KernelVersion), "bzImage")
	initrdFile := filepath.Join(storePath("initrd-linux-"+sm.KernelVersion), "initrd")
	copyFile(t, filepath.Join(src, imagedir.FileName(manifest.PartKernel)), kernelFile)
	copyFile(t, filepath.Join(src, imagedir.FileName(manifest.PartInitrd)), initrdFile)
	// closureInfo's store-paths: one per package of the Debian root.
	var paths []string
	for i, p := range sm.Packages {
		paths = append(paths, fmt.Sprintf("/nix/store/%032d-%s-%s", i, p.Name, p.Version))
	}
	storePaths := filepath.Join(storePath("closure-info"), "store-paths")
	if err := os.WriteFile(storePaths, []byte(strings.Join(paths, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	// The image's own words: what the derivation gives as
	// "init=${toplevel}/init ${toString config.boot.kernelParams}".
	var words []string
	for _, w := range strings.Fields(sm.Cmdline) {
		if k, _, _ := strings.Cut(w, "="); k != "roothash" && !strings.HasPrefix(k, "systemd.verity_") {
			words = append(words, w)
		}
	}
	out := filepath.Join(t.TempDir(), "result")
	pack := exec.Command("bash", filepath.Join(harness.RepoRoot(), "nix", "pack-image.sh"))
	pack.Env = append(os.Environ(),
		"PATH="+b.Bin+":"+os.Getenv("PATH"),
		"out="+out, "imageName=nixos-agent",
		"kernelFile="+kernelFile, "kernelVersion="+sm.KernelVersion, "initrdFile="+initrdFile,
		// The derivation's system is the closure laid out as a tree,
		// made into erofs by carrel image pack; here it is the Debian
		// builder's erofs, a whole root.
		"system="+filepath.Join(src, imagedir.FileName(manifest.PartSystem)), "verityMount=root",
		"kernelCmdline="+strings.Join(words, " "), "storePaths="+storePaths)
	start := time.Now()
	o, err := pack.CombinedOutput()
	if err != nil {
		t.Fatalf("pack-image.sh: %v\n%s", err, o)
	}
	t.Logf("pack-image.sh took %s:\n%s", time.Since(start).Round(time.Millisecond), o)
	if !strings.Contains(string(o), out+": ok") {
		t.Errorf("pack-image.sh did not check its result:\n%s", o)
	}
	packed, err := imagedir.Read(out)
	if err != nil {
		t.Fatal(err)
	}
	pm := packed.Manifest
	if pm.Name != "nixos-agent" || pm.Verity.RootHash != sm.Verity.RootHash || pm.System.Digest != sm.System.Digest {
		t.Errorf("packed image: name %s, root hash %s, system %s; want nixos-agent, %s, %s",
			pm.Name, pm.Verity.RootHash, pm.System.Digest, sm.Verity.RootHash, sm.System.Digest)
	}
	if pm.Cmdline != sm.Cmdline {
		t.Errorf("packed command line:\n%s\nwant the Debian builder's:\n%s", pm.Cmdline, sm.Cmdline)
	}
	bash := findPackage(sm.Packages, "bash")
	if got := findPackage(pm.Packages, "bash"); bash == nil || got == nil || got.Version != bash.Version {
		t.Errorf("bash in the packed image's packages: %+v; want %+v", got, bash)
	}

	// Bad outputs an operator may hand to import.
	gone := filepath.Join(t.TempDir(), "result")
	if err := os.Symlink("/nix/store/00000000000000000000000000000000-carrel-image-nixos-agent", gone); err != nil {
		t.Fatal(err)
	}
	unfinished := linkImage(t, out, func(m []byte) []byte { return nil })
	var other []byte
	for range sm.Verity.RootHash {
		other = append(other, 'a')
	}
	disagrees := linkImage(t, out, func(m []byte) []byte {
		return bytes.ReplaceAll(m, []byte(sm.Verity.RootHash), other)
	})

	// carreld imports declared images at start; the unfinished one is
	// left out, and says why.
	d := harness.New(t, "--import-image", out, "--import-image", unfinished)
	d.Start()
	if !strings.Contains(d.Logs(), `msg="declared image imported" dir=`+out) ||
		!strings.Contains(d.Logs(), `msg="declared image not imported; fix or rebuild it, then restart carreld" dir=`+unfinished) {
		t.Errorf("carreld's imports at start:\n%s", d.Logs())
	}
	d.Stop()
	d.Start()
	if !strings.Contains(d.Logs(), `msg="declared image already imported" dir=`+out) {
		t.Errorf("carreld's second start did not find the image stored:\n%s", d.Logs())
	}
	if r := d.Must("image", "import", out); !strings.Contains(r, "already imported") {
		t.Errorf("import of the same output: %q", r)
	}
	if sbom := d.Must("image", "sbom", "nixos-agent", "--format", "cyclonedx"); !strings.Contains(sbom, `"purl": "pkg:nix/bash@`) {
		t.Errorf("the SBOM does not list the closure's bash as a Nix package:\n%.600s", sbom)
	}
	before := d.Must("image", "ls")
	for _, c := range []struct{ dir, want string }{
		{gone, "which is gone (an old build result"},
		{unfinished, "has no manifest.json: not an image directory, or a build that did not finish"},
		{disagrees, "root hash is " + sm.Verity.RootHash + ", manifest says " + string(other)},
	} {
		r := d.Carrel("image", "import", c.dir)
		if r.Code == 0 || !strings.Contains(r.Stderr, c.want) {
			t.Errorf("import %s: %+v; want an error saying %q", c.dir, r, c.want)
		}
	}
	if after := d.Must("image", "ls"); after != before {
		t.Errorf("failed imports changed the store:\n%s\n%s", before, after)
	}

	start = time.Now()
	d.Must("vm", "create", "nx", "--image", "nixos-agent", "--memory", "1G", "--policy", d.ApplyPolicy("mount-state", func(s map[string]any) {
		// Root, who may reach systemd (systemd-run below, which looks
		// for /run/systemd/system).
		harness.AllowRoot(s)
		fs := s["fs"].(map[string]any)
		fs["read_only"] = append(fs["read_only"].([]any), "/run/systemd")
	}))
	t.Logf("create to agent-ready took %s", time.Since(start).Round(time.Millisecond))
	got := d.Must("exec", "nx", "--", "sh", "-c", "cat /proc/1/comm /proc/cmdline")
	for _, want := range []string{"systemd\n", "roothash=" + sm.Verity.RootHash, "carrel.state=disk"} {
		if !strings.Contains(got, want) {
			t.Errorf("no %q in:\n%s", want, got)
		}
	}

	// carrel-agent --mount-state, as the NixOS initrd runs it (from
	// systemd, outside any command's sandbox), on this VM's state disk:
	// the disk's ext4 on ROOT/var, root's, with ROOT/home and ROOT/root
	// bound from it.
	mounted := d.Must("exec", "--user", "root", "nx", "--", "sh", "-c",
		// A oneshot that systemd-run waits for, over systemd's own socket
		// (the image has no D-Bus), logging to a file the command reads.
		"systemd-run --unit=carrel-mount-state -p Type=oneshot --quiet"+
			" -p StandardOutput=append:/tmp/mount-state.log -p StandardError=append:/tmp/mount-state.log "+
			debian.AgentPath+" --mount-state /mnt/sysroot; rc=$?; cat /tmp/mount-state.log; [ $rc = 0 ] && "+
			"stat -c 'var %u:%g %a' /mnt/sysroot/var && cat /proc/self/mountinfo")
	// mountinfo(5): ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE ...
	mounts := map[string]string{} // mount point: "MAJ:MIN ROOT FSTYPE"
	for _, l := range strings.Split(mounted, "\n") {
		f := strings.Fields(l)
		for i := 6; i+1 < len(f); i++ {
			if f[i] == "-" && len(f) > 4 {
				mounts[f[4]] = f[2] + " " + f[3] + " " + f[i+1]
				break
			}
		}
	}
	dev, _, _ := strings.Cut(mounts["/run/carrel/state"], " ")
	if !strings.Contains(mounted, "writable layer on the state disk") || !strings.Contains(mounted, "var 0:0 755") {
		t.Errorf("--mount-state:\n%s", mounted)
	}
	for mp, want := range map[string]string{
		"/mnt/sysroot/var":  dev + " / ext4",
		"/mnt/sysroot/home": dev + " /home ext4",
		"/mnt/sysroot/root": dev + " /roothome ext4",
	} {
		if dev == "" || mounts[mp] != want {
			t.Errorf("--mount-state: %s is %q; want %q (the state disk's)", mp, mounts[mp], want)
		}
	}
}

// linkImage makes a copy of the image directory dir from hard links, with
// its manifest rewritten by edit (nil leaves it out).
func linkImage(t *testing.T, dir string, edit func([]byte) []byte) string {
	t.Helper()
	dst := t.TempDir()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.Name() == imagedir.ManifestFile {
			continue
		}
		if err := os.Link(filepath.Join(dir, e.Name()), filepath.Join(dst, e.Name())); err != nil {
			t.Fatal(err)
		}
	}
	m, err := os.ReadFile(filepath.Join(dir, imagedir.ManifestFile))
	if err != nil {
		t.Fatal(err)
	}
	if m = edit(m); m != nil {
		if err := os.WriteFile(filepath.Join(dst, imagedir.ManifestFile), m, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dst
}

func findPackage(ps []manifest.Package, name string) *manifest.Package {
	for i := range ps {
		if ps[i].Name == name {
			return &ps[i]
		}
	}
	return nil
}
