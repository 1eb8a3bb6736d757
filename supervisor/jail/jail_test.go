package jail

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestMain(m *testing.M) {
	Main()
	os.Exit(m.Run())
}

const testUID = 0x6000ff00

// start runs argv in a jail that shows binds, as testUID.
func start(t *testing.T, binds []Bind, argv ...string) (*exec.Cmd, string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("jails need root")
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	root := filepath.Join(dir, "root")
	if err := os.Mkdir(root, 0o700); err != nil {
		t.Fatal(err)
	}
	cmd, err := Command(self, Spec{Root: root, UID: testUID, GID: testUID, Binds: binds, PIDFile: filepath.Join(dir, "pid"), Argv: argv})
	if err != nil {
		t.Fatal(err)
	}
	return cmd, dir
}

func TestJailSeesOnlyItsBinds(t *testing.T) {
	host := t.TempDir()
	mine := filepath.Join(host, "mine")
	os.WriteFile(mine, []byte("mine\n"), 0o666)
	os.Chmod(mine, 0o666) // only the read-only bind keeps the jail from writing it
	secret := filepath.Join(host, "secret")
	os.WriteFile(secret, []byte("secret\n"), 0o644) // readable, but not shown
	rootOnly := filepath.Join(host, "rootonly")
	os.WriteFile(rootOnly, []byte("root\n"), 0o600) // shown, but root's
	script := `id -u; id -g; cat ` + mine + `; cat ` + secret + ` 2>/dev/null || echo no-secret; cat ` + rootOnly + ` 2>/dev/null || echo no-rootonly; ls /; echo x > /new 2>/dev/null || echo ro-root; echo x >> ` + mine + ` 2>/dev/null || echo ro-mine`
	cmd, _ := start(t, []Bind{{Path: mine}, {Path: rootOnly}}, "/bin/sh", "-c", script)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		t.Fatalf("%v: %s", err, out.String())
	}
	got := strings.Fields(out.String())
	uid := strconv.Itoa(testUID)
	want := []string{uid, uid, "mine", "no-secret", "no-rootonly", "bin", "dev", "etc", "lib", "lib64", "sbin", "tmp", "usr", "ro-root", "ro-mine"}
	for _, w := range want {
		if !contains(got, w) {
			t.Errorf("jail printed %q, want %q among it", out.String(), w)
		}
	}
	for _, bad := range []string{"secret", "root", "proc", "var", "home"} {
		if contains(got, bad) {
			t.Errorf("jail printed %q: %q should not be there", out.String(), bad)
		}
	}
}

func contains(s []string, w string) bool {
	for _, x := range s {
		if x == w {
			return true
		}
	}
	return false
}

func TestJailDropsPrivilege(t *testing.T) {
	// A descriptor this process holds without close-on-exec, as carreld
	// may have inherited one: the program must not get it.
	leak, err := syscall.Open("/dev/null", syscall.O_RDONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(leak)
	cmd, _ := start(t, nil, "/bin/sleep", "30")
	var out bytes.Buffer
	cmd.Stderr = &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	pid := strconv.Itoa(cmd.Process.Pid)
	var status string
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		b, err := os.ReadFile("/proc/" + pid + "/status")
		if err != nil {
			t.Fatalf("%v: %s", err, out.String())
		}
		if status = string(b); strings.Contains(status, "\nUid:\t"+strconv.Itoa(testUID)) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	field := func(name string) string {
		for _, l := range strings.Split(status, "\n") {
			if v, ok := strings.CutPrefix(l, name+":"); ok {
				return strings.TrimSpace(v)
			}
		}
		return ""
	}
	u := strconv.Itoa(testUID)
	checks := map[string]string{
		"Uid": u + "\t" + u + "\t" + u + "\t" + u, "Gid": u + "\t" + u + "\t" + u + "\t" + u,
		"Groups": "", "CapInh": "0000000000000000", "CapPrm": "0000000000000000", "CapEff": "0000000000000000",
		"CapBnd": "0000000000000000", "CapAmb": "0000000000000000", "NoNewPrivs": "1",
	}
	for k, want := range checks {
		if got := field(k); got != want {
			t.Errorf("%s: %q, want %q (stderr %q)", k, got, want, out.String())
		}
	}
	if fds, err := os.ReadDir("/proc/" + pid + "/fd"); err != nil || len(fds) != 3 {
		names := []string{}
		for _, f := range fds {
			target, _ := os.Readlink("/proc/" + pid + "/fd/" + f.Name())
			names = append(names, f.Name()+"->"+target)
		}
		t.Errorf("the program holds descriptors %v (%v), want 0, 1 and 2 alone", names, err)
	}
	for _, ns := range []string{"mnt", "net", "ipc", "uts"} {
		mine, _ := os.Readlink("/proc/self/ns/" + ns)
		its, _ := os.Readlink("/proc/" + pid + "/ns/" + ns)
		if mine == its || its == "" {
			t.Errorf("namespace %s: the jail's is %q, ours %q", ns, its, mine)
		}
	}
}

func TestJailWritesPIDFile(t *testing.T) {
	cmd, dir := start(t, nil, "/bin/true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(dir, "pid"))
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(b))
	if len(f) != 2 || f[0] != strconv.Itoa(cmd.Process.Pid) {
		t.Errorf("pid file %q, want pid %d and a start time", b, cmd.Process.Pid)
	}
}

func TestCommandRefusesRoot(t *testing.T) {
	if _, err := Command("/x", Spec{Root: "/r", UID: 0, GID: 5, Argv: []string{"/bin/true"}}); err == nil {
		t.Error("uid 0 accepted")
	}
	if _, err := Command("/x", Spec{Root: "/r", UID: 5, GID: 5, Argv: []string{"true"}}); err == nil {
		t.Error("a relative program accepted")
	}
}
