package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/tests/harness"
)

// activityLog is what the audit log says of a VM's workspace activity.
type activityLog struct {
	records  []audit.Record
	events   []audit.ActivityEvent
	dropped  uint64
	sessions map[string]bool // of the VM's host records
	execIDs  []string        // of its exec.exit records
}

// readActivity reads the audit log in dir, as a reviewer would, while
// carreld may still be appending to it: a record being written when the
// scan reaches it is left for the next read.
func readActivity(t *testing.T, dir, vm string) activityLog {
	t.Helper()
	a := activityLog{sessions: map[string]bool{}}
	_ = audit.Scan(dir, func(_ uint64, _ int64, p []byte) error {
		r, err := audit.Decode(p)
		if err != nil {
			t.Fatalf("decode: %v", err)
		}
		if r.VM != vm {
			return nil
		}
		if r.Provenance == audit.Host && r.Session != "" {
			a.sessions[r.Session] = true
		}
		if r.Kind == audit.KindExecExit {
			var x struct {
				ExecID string `json:"exec_id"`
			}
			if json.Unmarshal(r.Data, &x) == nil && x.ExecID != "" {
				a.execIDs = append(a.execIDs, x.ExecID)
			}
		}
		if r.Kind != audit.KindFileActivity {
			return nil
		}
		var d audit.Activity
		if err := json.Unmarshal(r.Data, &d); err != nil {
			t.Fatalf("file.activity record %d: %v: %s", r.Seq, err, r.Data)
		}
		a.records = append(a.records, r)
		a.events = append(a.events, d.Events...)
		a.dropped += d.Dropped
		return nil
	})
	return a
}

// has reports whether an event of op on path by the command id was
// recorded.
func (a activityLog) has(op, path, id string) bool {
	return slices.ContainsFunc(a.events, func(e audit.ActivityEvent) bool {
		return e.Op == op && e.Path == path && (id == "" || e.ExecID == id)
	})
}

func (a activityLog) String() string {
	var b strings.Builder
	for _, e := range a.events {
		fmt.Fprintf(&b, "  %s %s pid=%d exec=%s ns=%d\n", e.Op, e.Path, e.PID, e.ExecID, e.Ns)
	}
	fmt.Fprintf(&b, "  (dropped %d)", a.dropped)
	return b.String()
}

// TestActivity runs commands in a real VM that create, write, rename and
// remove files in /workspace, and checks that the audit log has what the
// guest's fanotify watch saw: guest-provenance file.activity records of
// the VM's session, naming each path with the right op and the id of the
// command that did it, the short-lived mv and rm among them; and that a
// file the agent itself wrote (carrel cp) is not reported.
func TestActivity(t *testing.T) {
	d := harness.New(t)
	d.Start()
	d.BuildImage()
	dir := filepath.Join(d.State, "audit")
	d.Must("vm", "create", "act", "--memory", "256M")

	// The agent's own write, through the file API.
	local := filepath.Join(t.TempDir(), "from-host.txt")
	if err := os.WriteFile(local, []byte("from the host\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	d.Must("cp", local, "act:/workspace/from-host.txt")

	// A detached command prints its id; attach waits for its end.
	// Subshells are processes of their own, gone long before their events
	// are read; the last one is orphaned, and writes after its command has
	// ended.
	script := `echo hello > a.txt
mkdir sub
echo x > sub/b.txt
(mv a.txt sub/c.txt)
(rm sub/b.txt)
cat sub/c.txt
(rm -r sub)
cat from-host.txt >/dev/null
(sh -c 'sleep 1; echo late > late.txt' >/dev/null 2>&1 &)`
	id := strings.TrimSpace(d.Must("exec", "--detach", "act", "--", "/bin/sh", "-c", script))
	if len(id) != 16 {
		t.Fatalf("exec --detach printed %q, want a command id", id)
	}
	if out := d.Must("attach", "act", id); !strings.Contains(out, "hello") {
		t.Fatalf("the command printed %q", out)
	}
	// And one through the plain Exec call.
	d.Must("exec", "act", "--", "/bin/sh", "-c", "echo y > exec.txt")

	// Each command runs in a cgroup of its own, which it cannot leave.
	cg := d.Must("exec", "act", "--", "/bin/sh", "-c", "cat /proc/self/cgroup; echo $$ > /sys/fs/cgroup/cgroup.procs && echo escaped; true")
	if !regexp.MustCompile(`(?m)^0::/carrel/[0-9a-f]{16}$`).MatchString(cg) || strings.Contains(cg, "escaped") {
		t.Errorf("a command's cgroup: %q; want 0::/carrel/<a group of its own>, and no way out", cg)
	}

	w := func(p string) string { return "/workspace/" + p }
	want := [][2]string{
		{"create", w("a.txt")}, {"open", w("a.txt")}, {"modify", w("a.txt")},
		{"create", w("sub")}, {"create", w("sub/b.txt")}, {"modify", w("sub/b.txt")},
		{"move_from", w("a.txt")}, {"move_to", w("sub/c.txt")},
		{"delete", w("sub/b.txt")}, {"open", w("sub/c.txt")},
		{"delete", w("sub/c.txt")}, {"delete", w("sub")},
		{"open", w("from-host.txt")}, {"create", w("late.txt")},
	}
	var a activityLog
	deadline := time.Now().Add(60 * time.Second)
	for {
		a = readActivity(t, dir, "act")
		missing := 0
		for _, e := range want {
			if !a.has(e[0], e[1], id) {
				missing++
			}
		}
		if missing == 0 && a.has("create", w("exec.txt"), "") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 60s, %d of %d events of command %s missing (or exec.txt's); the log has:\n%s", missing, len(want), id, a)
		}
		time.Sleep(500 * time.Millisecond)
	}
	t.Logf("activity of command %s:\n%s", id, a)

	for _, r := range a.records {
		if r.Provenance != audit.Guest {
			t.Errorf("file.activity record %d has provenance %q, want guest", r.Seq, r.Provenance)
		}
		if !strings.HasPrefix(r.Session, "ses_") || !a.sessions[r.Session] {
			t.Errorf("file.activity record %d has session %q; the VM's host records have %v", r.Seq, r.Session, a.sessions)
		}
	}
	for _, e := range a.events {
		if e.PID <= 0 || e.ExecID == "" {
			t.Errorf("event without a process or command: %+v", e)
		}
		if (e.Op == "create" || e.Op == "modify") && e.Path == w("from-host.txt") {
			t.Errorf("the agent's own write (carrel cp) was reported as activity: %+v", e)
		}
	}
	// exec.txt's command is another one, and the host's record of that
	// command names the same exec id, so a reviewer can join them.
	for _, e := range a.events {
		if e.Path == w("exec.txt") && e.ExecID == id {
			t.Errorf("exec.txt attributed to the detached command %s", id)
		}
		if e.Path == w("exec.txt") && !slices.Contains(a.execIDs, e.ExecID) {
			t.Errorf("exec.txt's command %s has no exec.exit record naming it (exit records name %v)", e.ExecID, a.execIDs)
		}
	}
	// Clients cannot have the guest's stream: it is carreld's, for the log.
	c := client.New(d.Socket)
	req := connect.NewRequest(&agentv1.ActivityRequest{})
	req.Header().Set(protocol.VMHeader, "act")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if s, err := c.Agent.Activity(ctx, req); err == nil {
		for s.Receive() {
			t.Errorf("a client got the guest's activity: %v", s.Msg())
		}
		if err := s.Err(); connect.CodeOf(err) != connect.CodePermissionDenied || !strings.Contains(err.Error(), "not relayed") {
			t.Errorf("Activity through carreld's API: %v, want permission denied", err)
		}
		s.Close()
	} else if connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Errorf("Activity through carreld's API: %v, want permission denied", err)
	}

	// The shell, the subshells and the orphan: one command, several
	// processes.
	pidOf := func(op, p string) int32 {
		for _, e := range a.events {
			if e.Op == op && e.Path == p && e.ExecID == id {
				return e.PID
			}
		}
		return 0
	}
	shell, mv, late := pidOf("create", w("a.txt")), pidOf("move_from", w("a.txt")), pidOf("create", w("late.txt"))
	if shell == mv || shell == late || mv == late {
		t.Errorf("pids: shell %d, subshell %d, orphan %d; want three processes", shell, mv, late)
	}
}
