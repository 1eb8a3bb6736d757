//go:build linux

package exec

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"os"
	osexec "os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/carrel-os/carrel/guest-agent/cgroups"
	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

// testGroups makes a cgroup of the test's own under a cgroup v2 hierarchy,
// or skips.
func testGroups(t *testing.T) *cgroups.Dir {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to make cgroups")
	}
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		t.Skip(err)
	}
	defer f.Close()
	mount := ""
	sc := bufio.NewScanner(f)
	for sc.Scan() && mount == "" {
		fields := strings.Fields(sc.Text())
		for i, fl := range fields {
			if fl == "-" && i+1 < len(fields) && fields[i+1] == "cgroup2" && fields[3] == "/" {
				mount = fields[4]
			}
		}
	}
	if mount == "" {
		t.Skip("no cgroup v2 hierarchy mounted")
	}
	var b [4]byte
	rand.Read(b[:])
	d, err := cgroups.Open(mount, "carrel-exec-test-"+hex.EncodeToString(b[:]))
	if err != nil {
		t.Skipf("cannot make a cgroup: %v", err)
	}
	t.Cleanup(func() {
		entries, _ := os.ReadDir(d.Path())
		for _, e := range entries {
			if e.IsDir() {
				os.Remove(filepath.Join(d.Path(), e.Name()))
			}
		}
		os.Remove(d.Path())
	})
	return d
}

// TestCommandsRunInTheirOwnGroup checks that a command starts in a group
// named by its id, that OnStart is told its pid and id, and that the group
// goes when the command ends.
func TestCommandsRunInTheirOwnGroup(t *testing.T) {
	r := runner(t)
	r.Cgroups = testGroups(t)
	var startedPid int
	var startedID string
	r.OnStart = func(pid int, id string) { startedPid, startedID = pid, id }
	var res result
	err := r.Run(context.Background(), &agentv1.ExecRequest{Argv: []string{"cat", "/proc/self/cgroup"}}, res.send)
	if err != nil {
		t.Fatal(err)
	}
	if code := res.exit(t).Code; code != 0 {
		t.Fatalf("exit %d: %s", code, res.stderr.String())
	}
	st := res.events[0].GetStarted()
	if startedPid != int(st.Pid) || startedID != st.Id || len(st.Id) != 16 {
		t.Errorf("OnStart told pid %d id %q; Started says %d %q", startedPid, startedID, st.Pid, st.Id)
	}
	want := "0::/" + filepath.Base(r.Cgroups.Path()) + "/" + st.Id + "\n"
	if !strings.Contains(res.stdout.String(), want) {
		t.Errorf("the command's /proc/self/cgroup is %q, want the line %q", res.stdout.String(), want)
	}
	if _, err := os.Stat(filepath.Join(r.Cgroups.Path(), st.Id)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the command's group is still there after it ended: %v", err)
	}
}

// runAndWaitForSpare runs a command, then waits for the group made ahead
// for the next one.
func runAndWaitForSpare(t *testing.T, r *Runner) *cgroups.Group {
	t.Helper()
	var res result
	if err := r.Run(context.Background(), &agentv1.ExecRequest{Argv: []string{"true"}}, res.send); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		r.mu.Lock()
		spare := r.spare
		r.mu.Unlock()
		if spare != nil {
			return spare
		}
	}
	t.Fatal("no group was made ahead after a command started")
	return nil
}

// TestNextGroupIsMadeAhead checks that once a command has started, the
// next command's group is made in the background, and that the next
// command runs in it.
func TestNextGroupIsMadeAhead(t *testing.T) {
	r := runner(t)
	r.Cgroups = testGroups(t)
	spare := runAndWaitForSpare(t, r).Name
	if fi, err := os.Stat(filepath.Join(r.Cgroups.Path(), spare)); err != nil || !fi.IsDir() {
		t.Fatalf("the group made ahead is not there: %v", err)
	}
	var res result
	if err := r.Run(context.Background(), &agentv1.ExecRequest{Argv: []string{"cat", "/proc/self/cgroup"}}, res.send); err != nil {
		t.Fatal(err)
	}
	st := res.events[0].GetStarted()
	want := "0::/" + filepath.Base(r.Cgroups.Path()) + "/" + spare + "\n"
	if st.Id != spare || !strings.Contains(res.stdout.String(), want) {
		t.Errorf("the next command is %s, in %q; want it in the group made ahead, %s", st.Id, res.stdout.String(), spare)
	}
}

// TestSpareGroupChangedByRootIsNotUsed: a group made ahead that root in
// the guest has put a process in is not the next command's, and the
// process is no command's.
func TestSpareGroupChangedByRootIsNotUsed(t *testing.T) {
	r := runner(t)
	r.Cgroups = testGroups(t)
	spare := runAndWaitForSpare(t, r)
	sleeper := osexec.Command("sleep", "30")
	sleeper.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: spare.FD()}
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { // before testGroups': the group must be empty to go
		sleeper.Process.Kill()
		sleeper.Wait()
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			if err := os.Remove(filepath.Join(r.Cgroups.Path(), spare.Name)); err == nil || errors.Is(err, os.ErrNotExist) {
				return
			}
		}
	})
	var res result
	if err := r.Run(context.Background(), &agentv1.ExecRequest{Argv: []string{"cat", "/proc/self/cgroup"}}, res.send); err != nil {
		t.Fatal(err)
	}
	if st := res.events[0].GetStarted(); st.Id == spare.Name || strings.Contains(res.stdout.String(), "/"+spare.Name+"\n") {
		t.Errorf("the next command, %s, ran in the group root filled: %q", st.Id, res.stdout.String())
	}
	if id, ok := r.Cgroups.ExecID(sleeper.Process.Pid); ok {
		t.Errorf("the process root put in the group made ahead is said to be command %q's", id)
	}
}

// TestGroupsAreKeptForUnprivilegedCommands: the group of a command run as
// an unprivileged user is kept once it ends, and the next command runs in
// it under an id of its own; a command run as root, which could have
// changed its group, leaves none behind.
func TestGroupsAreKeptForUnprivilegedCommands(t *testing.T) {
	r := runner(t)
	r.Cgroups = testGroups(t) // as root, or it skips
	r.Dir = "/"
	if _, err := r.users.Lookup(r.Users, "nobody"); err != nil {
		t.Skipf("no user nobody to run a command as: %v", err)
	}
	group := func(user string) (id, cgroup string) {
		t.Helper()
		var res result
		err := r.Run(context.Background(), &agentv1.ExecRequest{Argv: []string{"cat", "/proc/self/cgroup"}, User: user}, res.send)
		if err != nil {
			t.Fatal(err)
		}
		if code := res.exit(t).Code; code != 0 {
			t.Fatalf("exit %d: %s", code, res.stderr.String())
		}
		prefix := "0::/" + filepath.Base(r.Cgroups.Path()) + "/"
		for line := range strings.Lines(res.stdout.String()) {
			if g, ok := strings.CutPrefix(strings.TrimSpace(line), prefix); ok {
				return res.events[0].GetStarted().Id, g
			}
		}
		t.Fatalf("the command is in no group of the runner's: %q", res.stdout.String())
		return "", ""
	}
	id1, g1 := group("nobody")
	if _, err := os.Stat(filepath.Join(r.Cgroups.Path(), g1)); err != nil {
		t.Fatalf("the group of a command run as nobody was not kept: %v", err)
	}
	id2, g2 := group("nobody")
	if g2 != g1 || id2 == id1 {
		t.Errorf("the second command is %s in group %s; want a new id in the kept group %s (the first was %s)", id2, g2, g1, id1)
	}
	_, g3 := group("root")
	if g3 != g1 {
		t.Errorf("the root command ran in group %s, want the kept group %s", g3, g1)
	}
	if _, err := os.Stat(filepath.Join(r.Cgroups.Path(), g3)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the group of a command run as root is still there: %v", err)
	}
}
