package tests

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/carrel-os/carrel/tests/harness"
)

// TestJailedQEMU checks the qemu driver's jail on real VMs, with carreld
// holding only its unit's capabilities: each QEMU runs
// as a user of its own with no capabilities and no_new_privs, in
// namespaces of its own, and from inside its jail it reaches its own disk
// but neither carreld's state, the audit key, nor another VM's disk.
func TestJailedQEMU(t *testing.T) {
	harness.RequireDriver(t, "qemu")
	for _, tool := range []string{"nsenter", "setpriv"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skip("needs " + tool + " (util-linux)")
		}
	}
	d := harness.New(t)
	// With only the capabilities carreld's unit gives it (no
	// CAP_DAC_OVERRIDE or CAP_FOWNER, say), and no_new_privs, as under
	// systemd: the image build too.
	d.StartUnder("setpriv", "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all,+sys_admin,+chown,+setpcap,+setuid,+setgid", "--")
	d.BuildImage()
	status := func(pid int) map[string]string {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]string{}
		for _, l := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(l, ":"); ok {
				out[k] = strings.TrimSpace(v)
			}
		}
		return out
	}
	if st := status(d.Pid()); st["CapEff"] != "00000000002001c1" || st["NoNewPrivs"] != "1" {
		t.Fatalf("carreld runs with CapEff %s NoNewPrivs %s, want the unit's five capabilities (2001c1) and 1", st["CapEff"], st["NoNewPrivs"])
	}
	d.Must("vm", "create", "a", "--image", "dev", "--memory", "384M", "--cpus", "1")
	d.Must("vm", "create", "b", "--image", "dev", "--memory", "384M", "--cpus", "1")
	va, _ := vmNamed(t, d, "a")
	vb, _ := vmNamed(t, d, "b")
	sa, sb := status(va.Pid), status(vb.Pid)
	uid := strings.Fields(sa["Uid"])[0]
	if uid == "0" || sa["Uid"] != strings.Repeat(uid+"\t", 3)+uid || sa["Gid"] != sa["Uid"] {
		t.Fatalf("qemu of a: Uid %q Gid %q, want one non-root id throughout", sa["Uid"], sa["Gid"])
	}
	if sb["Uid"] == sa["Uid"] {
		t.Errorf("a and b share the user %s", sa["Uid"])
	}
	for k, want := range map[string]string{"CapEff": "0000000000000000", "CapPrm": "0000000000000000", "CapBnd": "0000000000000000",
		"CapAmb": "0000000000000000", "NoNewPrivs": "1", "Seccomp": "2"} {
		if sa[k] != want {
			t.Errorf("qemu of a: %s is %q, want %q", k, sa[k], want)
		}
	}
	for _, ns := range []string{"mnt", "net"} {
		mine, _ := os.Readlink("/proc/self/ns/" + ns)
		its, _ := os.Readlink("/proc/" + strconv.Itoa(va.Pid) + "/ns/" + ns)
		if its == "" || its == mine {
			t.Errorf("qemu of a shares the %s namespace (%q)", ns, its)
		}
	}

	// The disk a's QEMU writes is its user's; b's is b's.
	ownDisk := func(vm, uid string) string {
		ents, _ := os.ReadDir(filepath.Join(d.State, "vms", vm))
		for _, e := range ents {
			fi, err := e.Info()
			if err == nil && fi.Mode().IsRegular() && strconv.FormatUint(uint64(fi.Sys().(*syscall.Stat_t).Uid), 10) == uid {
				return filepath.Join(d.State, "vms", vm, e.Name())
			}
		}
		t.Fatalf("no file in vm %s's directory is its qemu's user's (%s)", vm, uid)
		return ""
	}
	diskA := ownDisk("a", uid)
	diskB := ownDisk("b", strings.Fields(sb["Uid"])[0])
	// inJail runs a shell command in a's mount namespace as its user (or
	// as root, when asRoot), and reports whether it succeeded.
	inJail := func(asRoot bool, script string) (bool, string) {
		args := []string{"-t", strconv.Itoa(va.Pid), "-m"}
		if !asRoot {
			args = append(args, "-S", uid, "-G", uid)
		}
		out, err := exec.Command("nsenter", append(args, "--", "/bin/sh", "-c", script)...).CombinedOutput()
		return err == nil, string(out)
	}
	if ok, out := inJail(false, "head -c 512 "+diskA+" >/dev/null"); !ok {
		t.Fatalf("a's qemu user cannot read its own disk from inside its jail: %s", out)
	}
	auditKey := filepath.Join(d.State, "audit", "key")
	if _, err := os.Stat(auditKey); err != nil {
		t.Fatalf("the audit key is not where the test looks: %v", err)
	}
	for _, c := range []struct{ what, script string }{
		{"the audit key", "head -c 1 " + auditKey},
		{"another vm's disk", "head -c 1 " + diskB},
		{"its own vm record", "head -c 1 " + filepath.Join(d.State, "vms", "a", "vm.json")},
		{"a file of its own in its vm's directory", "touch " + filepath.Join(d.State, "vms", "a", "planted")},
		{"the host's /etc", "head -c 1 /etc/passwd"},
	} {
		if ok, out := inJail(false, c.script); ok {
			t.Errorf("from inside a's jail, its qemu user reaches %s (%s): %s", c.what, c.script, out)
		}
	}
	// The state dir there is a skeleton: the directories that lead to
	// a's own files, nothing else.
	if ok, out := inJail(false, "ls "+d.State+"; ls "+filepath.Join(d.State, "vms")); !ok || strings.Fields(out)[0] != "images" || !slices.Equal(strings.Fields(out)[1:], []string{"vms", "a"}) {
		t.Errorf("carreld's state dir and its vms, seen from a's jail: %q, want images, vms; then a alone", out)
	}
	// Not a matter of permissions alone: even root there does not see them.
	for _, p := range []string{auditKey, diskB, filepath.Join(d.State, "vms", "b"), "/etc/passwd", "/root", "/var/log"} {
		if ok, _ := inJail(true, "test -e "+p); ok {
			t.Errorf("%s is in a's jail", p)
		}
	}
	// And the VMs work.
	if out := d.Must("exec", "a", "--", "echo", "jailed"); out != "jailed\n" {
		t.Errorf("exec in a: %q", out)
	}
	d.Must("vm", "stop", "a")
	d.Must("vm", "start", "a")
	if out := d.Must("exec", "a", "--", "echo", "again"); out != "again\n" {
		t.Errorf("exec in a after a restart: %q", out)
	}
}
