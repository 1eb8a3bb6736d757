//go:build linux

package sandbox

import (
	"bytes"
	"errors"
	"golang.org/x/sys/unix"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestValidate(t *testing.T) {
	long := "/" + strings.Repeat("a", MaxPathBytes)
	many := make([]string, MaxPaths+1)
	for i := range many {
		many[i] = "/x"
	}
	for _, tc := range []struct {
		name string
		p    Policy
		msg  string // in the error; "" means valid
	}{
		{"empty policy", Policy{}, ""},
		{"typical", Policy{ReadWrite: []string{"/workspace", "/tmp"}, ReadOnly: []string{"/usr", "/"},
			Denied: []string{"/etc/shadow"}, Revision: "r1"}, ""},
		{"exactly the caps", Policy{ReadOnly: many[:MaxPaths], Denied: []string{"/" + strings.Repeat("a", MaxPathBytes-1)}}, ""},
		{"relative", Policy{ReadWrite: []string{"workspace"}}, `read_write[0] "workspace": not absolute`},
		{"empty path", Policy{ReadOnly: []string{"/usr", ""}}, "read_only[1]"},
		{"trailing slash", Policy{ReadOnly: []string{"/usr/"}}, "not clean"},
		{"dot dot", Policy{Denied: []string{"/etc/../root"}}, "not clean"},
		{"double slash", Policy{ReadWrite: []string{"//tmp"}}, "not clean"},
		{"dot", Policy{ReadWrite: []string{"/tmp/."}}, "not clean"},
		{"nul", Policy{Denied: []string{"/etc/sha\x00dow"}}, "contains NUL"},
		{"too long", Policy{ReadOnly: []string{long}}, "more than 4096"},
		{"too many", Policy{ReadWrite: many}, "read_write has 257 entries"},
		{"long revision", Policy{Revision: long}, "revision"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.p.Validate()
			if tc.msg == "" {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				return
			}
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.msg) {
				t.Fatalf("Validate: %v, want ErrInvalid containing %q", err, tc.msg)
			}
		})
	}
}

func TestSetKeepsOldSandboxOnInvalid(t *testing.T) {
	var g Guard
	if g.Current() != nil {
		t.Fatal("a new Guard has a sandbox")
	}
	if _, err := g.Set(Policy{ReadWrite: []string{t.TempDir()}, Revision: "good"}); err != nil {
		t.Fatal(err)
	}
	before := g.Current()
	if _, err := g.Set(Policy{ReadWrite: []string{"relative"}, Revision: "bad"}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Set: %v, want ErrInvalid", err)
	}
	if g.Current() != before || before.Policy().Revision != "good" {
		t.Fatalf("the sandbox changed after an invalid Set: %+v", g.Current().Policy())
	}
	var nilGuard *Guard
	if nilGuard.Current() != nil {
		t.Fatal("a nil Guard has a sandbox")
	}
}

func TestSetCopiesThePolicy(t *testing.T) {
	var g Guard
	rw := []string{"/workspace"}
	if _, err := g.Set(Policy{ReadWrite: rw}); err != nil {
		t.Fatal(err)
	}
	rw[0] = "/"
	if r, ok := g.Current().RootOf("/etc"); ok {
		t.Fatalf("the caller's slice changed the sandbox: /etc under %v", r)
	}
}

func TestRootsAndDenied(t *testing.T) {
	sb := newSandbox(Policy{
		ReadWrite: []string{"/workspace", "/usr/local", "/srv"},
		ReadOnly:  []string{"/usr", "/workspace/ref", "/srv", "/etc"},
		Denied:    []string{"/etc/shadow", "/etc/ssh", "/workspace/.env"},
	})
	for _, tc := range []struct {
		p        string
		root     string // "" for none
		writable bool
	}{
		{"/workspace", "/workspace", true},
		{"/workspace/a/b", "/workspace", true},
		{"/workspacex", "", false},
		{"/workspace/ref/x", "/workspace/ref", false}, // the longest root decides
		{"/workspace/refx", "/workspace", true},
		{"/usr/bin/sh", "/usr", false},
		{"/usr/local/bin/x", "/usr/local", true},
		{"/srv/x", "/srv", true}, // read-write wins a tie
		{"/", "", false},
		{"/tmp", "", false},
	} {
		r, ok := sb.RootOf(tc.p)
		if tc.root == "" {
			if ok {
				t.Errorf("RootOf(%s) = %v, want none", tc.p, r)
			}
			continue
		}
		if !ok || r.Path != tc.root || r.Writable != tc.writable {
			t.Errorf("RootOf(%s) = %v %v, want %s writable=%v", tc.p, r, ok, tc.root, tc.writable)
		}
	}
	for p, want := range map[string]string{
		"/etc/shadow":           "/etc/shadow",
		"/etc/shadow-":          "",
		"/etc/ssh":              "/etc/ssh",
		"/etc/ssh/sshd_config":  "/etc/ssh",
		"/etc/sshx":             "",
		"/etc":                  "",
		"/workspace/.env":       "/workspace/.env",
		"/workspace/.env/x":     "/workspace/.env",
		"/workspace/sub/.env":   "",
		"/workspace/.environ":   "",
		"/workspace/.env.local": "",
	} {
		if d, _ := sb.DeniedAt(p); d != want {
			t.Errorf("DeniedAt(%s) = %q, want %q", p, d, want)
		}
	}
	for p, want := range map[string]string{
		"/etc":            "/etc/shadow",
		"/":               "/etc/shadow",
		"/workspace":      "/workspace/.env",
		"/etc/ssh":        "",
		"/etc/shadow":     "",
		"/workspace/sub":  "",
		"/etc/ssh/config": "",
	} {
		if d, _ := sb.DeniedBeneath(p); d != want {
			t.Errorf("DeniedBeneath(%s) = %q, want %q", p, d, want)
		}
	}
	root := newSandbox(Policy{ReadOnly: []string{"/"}})
	if r, ok := root.RootOf("/any/thing"); !ok || r.Path != "/" {
		t.Errorf("RootOf under / = %v %v", r, ok)
	}
}

func TestDeniedAlsoAsResolved(t *testing.T) {
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "real", "keys"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("real", filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	real, err := filepath.EvalSymlinks(dir)
	if err != nil {
		t.Fatal(err)
	}
	sb := newSandbox(Policy{Denied: []string{filepath.Join(dir, "link", "keys"), filepath.Join(dir, "link", "missing", "x")}})
	for _, p := range []string{
		filepath.Join(real, "real", "keys", "id"),
		filepath.Join(real, "real", "missing", "x"),
		filepath.Join(dir, "link", "keys"),
	} {
		if _, ok := sb.DeniedAt(p); !ok {
			t.Errorf("%s is not denied; denied: %q", p, sb.denied)
		}
	}
}

// requireLandlock skips the test unless the kernel has Landlock.
func requireLandlock(t *testing.T) int {
	t.Helper()
	abi, err := ABI()
	if err != nil {
		t.Skipf("needs Landlock (landlock ABI is 0): %v", err)
	}
	return abi
}

// systemRoots are what a shell needs to run, on this host.
var systemRoots = []string{"/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc"}

// spawnSh runs sh -c script as a child started through g.Spawn and
// returns its exit code and combined output.
func spawnSh(t *testing.T, g *Guard, script string) (int, string, bool) {
	t.Helper()
	sh, err := os.Open("/bin/sh")
	if err != nil {
		t.Skip("no /bin/sh")
	}
	sh.Close()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	var p *os.Process
	landlocked, err := g.Spawn(func() (err error) {
		p, err = os.StartProcess("/bin/sh", []string{"sh", "-c", script},
			&os.ProcAttr{Dir: "/", Files: []*os.File{nil, w, w}, Env: []string{"PATH=/usr/bin:/bin"}})
		return err
	})
	w.Close()
	if err != nil {
		t.Fatalf("Spawn: %v", err)
	}
	var out bytes.Buffer
	out.ReadFrom(r)
	st, err := p.Wait()
	if err != nil {
		t.Fatal(err)
	}
	return st.ExitCode(), out.String(), landlocked
}

func TestSpawnSetsNoNewPrivs(t *testing.T) {
	g := &Guard{}
	for _, g := range []*Guard{nil, g} {
		code, out, landlocked := spawnSh(t, g, "grep NoNewPrivs /proc/self/status")
		if code != 0 || !strings.Contains(out, "NoNewPrivs:\t1") || landlocked {
			t.Errorf("child: exit %d, landlocked %v, %q; want NoNewPrivs 1", code, landlocked, out)
		}
	}
	// The Guard's spawner thread alone is confined, and only until it is
	// retired.
	waitThreadsClean(t, g.spawnerTID())
	g.stopSpawner()
	waitThreadsClean(t)
}

// TestSpawnerIsKeptPerSandbox: commands under one sandbox are forked from
// one confined thread; a new sandbox gets a new thread, and the old one
// ends.
func TestSpawnerIsKeptPerSandbox(t *testing.T) {
	requireLandlock(t)
	g := &Guard{}
	t.Cleanup(g.stopSpawner)
	tids := func() (a, b int) {
		for _, p := range []*int{&a, &b} {
			if _, err := g.Spawn(func() error { *p = unix.Gettid(); return nil }); err != nil {
				t.Fatal(err)
			}
		}
		return a, b
	}
	if _, err := g.Set(Policy{ReadOnly: systemRoots}); err != nil {
		t.Fatal(err)
	}
	a1, a2 := tids()
	if a1 != a2 || a1 == unix.Getpid() {
		t.Fatalf("two spawns under one sandbox ran on threads %d and %d", a1, a2)
	}
	if _, err := g.Set(Policy{ReadOnly: systemRoots}); err != nil {
		t.Fatal(err)
	}
	b1, b2 := tids()
	if b1 != b2 || b1 == a1 {
		t.Fatalf("spawns under a new sandbox ran on threads %d and %d (the old one was %d)", b1, b2, a1)
	}
	waitThreadsClean(t, b1) // a1 has ended
}

func TestSpawnLandlocksOnlyTheChild(t *testing.T) {
	requireLandlock(t)
	base := t.TempDir()
	rw, out := filepath.Join(base, "rw"), filepath.Join(base, "out")
	for _, d := range []string{rw, out} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	g := &Guard{}
	st, err := g.Set(Policy{ReadWrite: []string{rw}, ReadOnly: append(systemRoots, filepath.Join(base, "missing"))})
	if err != nil {
		t.Fatal(err)
	}
	if !st.Landlock || st.ABI < 1 || !strings.Contains(st.Detail, "missing") {
		t.Fatalf("status %+v, want Landlock and the missing root named", st)
	}

	code, msg, landlocked := spawnSh(t, g, "echo x > "+out+"/f")
	if code == 0 || !landlocked || !strings.Contains(msg, "Permission denied") {
		t.Errorf("writing outside the roots: exit %d, landlocked %v, %q; want a permission error", code, landlocked, msg)
	}
	if _, err := os.Stat(filepath.Join(out, "f")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the file outside the roots exists: %v", err)
	}
	code, msg, _ = spawnSh(t, g, "echo x > "+rw+"/f && mkdir "+rw+"/d && mv "+rw+"/f "+rw+"/d/g && cat "+rw+"/d/g && ls /proc/self/fd >/dev/null && echo y >/dev/null")
	if code != 0 || msg != "x\n" {
		t.Errorf("working in the read-write root: exit %d, %q", code, msg)
	}
	code, msg, _ = spawnSh(t, g, "cat /etc/hostname >/dev/null && touch /etc/carrel-test")
	if code == 0 || !strings.Contains(msg, "Permission denied") {
		t.Errorf("writing in a read-only root: exit %d, %q", code, msg)
	}

	// The agent itself, on every one of its threads, stays free.
	var wg sync.WaitGroup
	for i := range 16 {
		wg.Go(func() {
			for j := range 20 {
				if err := os.WriteFile(filepath.Join(out, "agent"), []byte{byte(i), byte(j)}, 0o644); err != nil {
					t.Errorf("the agent cannot write outside the roots: %v", err)
					return
				}
			}
		})
	}
	for range 4 {
		spawnSh(t, g, "true")
	}
	wg.Wait()
	g.stopSpawner()
	waitThreadsClean(t)
}

func TestSpawnTakesTheNewestSandbox(t *testing.T) {
	requireLandlock(t)
	base := t.TempDir()
	a, b := filepath.Join(base, "a"), filepath.Join(base, "b")
	for _, d := range []string{a, b} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	g := &Guard{}
	if _, err := g.Set(Policy{ReadWrite: []string{a}, ReadOnly: systemRoots}); err != nil {
		t.Fatal(err)
	}
	old := g.Current()
	if _, err := g.Set(Policy{ReadWrite: []string{b}, ReadOnly: systemRoots}); err != nil {
		t.Fatal(err)
	}
	if old.rules.fd != -1 {
		t.Error("the replaced sandbox's ruleset is still open")
	}
	if code, msg, _ := spawnSh(t, g, "touch "+a+"/f"); code == 0 {
		t.Errorf("the old root is still writable: %q", msg)
	}
	if code, msg, _ := spawnSh(t, g, "touch "+b+"/f"); code != 0 {
		t.Errorf("the new root is not writable: %q", msg)
	}
}

func TestSpawnDoesNotStartWhatItCannotConfine(t *testing.T) {
	requireLandlock(t)
	g := &Guard{}
	if _, err := g.Set(Policy{ReadOnly: systemRoots}); err != nil {
		t.Fatal(err)
	}
	sb := g.Current()
	// A ruleset fd that is not a ruleset: landlock_restrict_self fails.
	sb.rules.mu.Lock()
	saved := sb.rules.fd
	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sb.rules.fd = int(f.Fd())
	sb.rules.mu.Unlock()
	defer func() { sb.rules.mu.Lock(); sb.rules.fd = saved; sb.rules.mu.Unlock() }()

	called := false
	_, err = g.Spawn(func() error { called = true; return nil })
	if !errors.Is(err, ErrConfine) || called {
		t.Fatalf("Spawn: %v, called %v; want ErrConfine and nothing started", err, called)
	}
}

// waitThreadsClean fails unless, soon, no thread of the test process has
// no_new_privs: the threads that confined children are gone.
func waitThreadsClean(t *testing.T, spawners ...int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		tainted := slices.DeleteFunc(taintedThreads(t), func(tid string) bool {
			return slices.Contains(spawners, atoi(tid))
		})
		if len(tainted) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("threads of the agent still have no_new_privs: %v", tainted)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func atoi(s string) int {
	n, _ := strconv.Atoi(s)
	return n
}

func taintedThreads(t *testing.T) []string {
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Skipf("no /proc: %v", err)
	}
	var tainted []string
	for _, task := range tasks {
		b, err := os.ReadFile(filepath.Join("/proc/self/task", task.Name(), "status"))
		if err != nil {
			continue // exited meanwhile
		}
		if slices.Contains(strings.Split(string(b), "\n"), "NoNewPrivs:\t1") {
			tainted = append(tainted, task.Name())
		}
	}
	return tainted
}

// TestSpawnGivesCommandsTheAgentsTimerSlack: the agent slows sysmon with a
// timer slack, which threads the runtime clones from it inherit; a command
// forked from such a thread still starts with the slack of the agent's
// main thread.
func TestSpawnGivesCommandsTheAgentsTimerSlack(t *testing.T) {
	main, err := os.ReadFile("/proc/self/timerslack_ns")
	if err != nil {
		t.Skipf("no timer slack to read: %v", err)
	}
	want := strings.TrimSpace(string(main))
	const other = "3000000" // 3 ms
	// Every thread but the main one, as if each were cloned from sysmon:
	// so is any thread the runtime makes from now on, which is where the
	// spawners run.
	setSlack := func(ns string) error {
		tasks, err := os.ReadDir("/proc/self/task")
		if err != nil {
			t.Fatal(err)
		}
		for _, task := range tasks {
			if task.Name() == strconv.Itoa(os.Getpid()) {
				continue
			}
			err := os.WriteFile("/proc/"+task.Name()+"/timerslack_ns", []byte(ns), 0)
			switch {
			case errors.Is(err, fs.ErrNotExist), errors.Is(err, unix.ESRCH): // the thread has ended since
			case errors.Is(err, fs.ErrPermission):
				return err
			case err != nil:
				t.Fatal(err)
			}
		}
		return nil
	}
	if err := setSlack(other); err != nil {
		t.Skipf("cannot set another thread's timer slack (needs CAP_SYS_NICE): %v", err)
	}
	// Back to the main thread's slack: "0" would give a thread made during
	// the test the slack it was made with, 3 ms.
	t.Cleanup(func() { setSlack(want) })
	g := &Guard{}
	t.Cleanup(g.stopSpawner)
	for _, g := range []*Guard{nil, g} {
		code, out, _ := spawnSh(t, g, "cat /proc/self/timerslack_ns")
		if got := strings.TrimSpace(out); code != 0 || got != want {
			t.Errorf("a command's timer slack: exit %d, %q; want the agent's %s, not its threads' %s", code, got, want, other)
		}
	}
}
