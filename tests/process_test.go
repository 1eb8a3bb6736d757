package tests

import (
	"bufio"
	"encoding/json"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/carrel-os/carrel/tests/harness"
)

// TestInteractiveProcesses covers the agent-computer side of exec: stdin,
// users, terminals, detach and attach, ps and kill, and carrel shell.
func TestInteractiveProcesses(t *testing.T) {
	d := harness.New(t)
	d.Start()
	d.BuildImage()
	// The default policy denies root in the guest; this VM's allows it.
	d.Must("vm", "create", "procs", "--policy", d.ApplyPolicy("root-ok", harness.AllowRoot))

	t.Run("stdin", func(t *testing.T) {
		r := d.CarrelStdin("hello\nworld\n", "exec", "-i", "procs", "--", "sh", "-c", "tr a-z A-Z; echo done")
		if r.Code != 0 || r.Stdout != "HELLO\nWORLD\ndone\n" {
			t.Errorf("stdin round trip: %+v", r)
		}
	})

	t.Run("users", func(t *testing.T) {
		if out := d.Must("exec", "procs", "--", "id", "-u"); out != "1000\n" {
			t.Errorf("default user uid = %q, want 1000 (agent)", out)
		}
		if out := d.Must("exec", "--user", "root", "procs", "--", "id", "-u"); out != "0\n" {
			t.Errorf("root uid = %q", out)
		}
		// Denied by policy before the guest is asked, naming the rule.
		if r := d.Carrel("exec", "--user", "nosuchuser", "procs", "--", "true"); r.Code != 125 || !strings.Contains(r.Stderr, "nosuchuser") || !strings.Contains(r.Stderr, "carrel.exec.default_deny") {
			t.Errorf("unknown user: %+v", r)
		}
		// What carrel cp puts in the guest belongs to the agent user.
		d.CarrelStdin("x", "cp", "-", "procs:/workspace/owned")
		if out := d.Must("exec", "procs", "--", "stat", "-c", "%u", "/workspace/owned"); out != "1000\n" {
			t.Errorf("copied file owner = %q", out)
		}
	})

	// The agent slows the runtime's sysmon thread with a timer slack of 4
	// ms (agent.slowSysmon); its main thread, and every command, keep the
	// kernel's 50 µs.
	t.Run("timer slack", func(t *testing.T) {
		out := d.Must("exec", "--user", "root", "procs", "--", "sh", "-c",
			`cat /proc/1/timerslack_ns; ls /proc/1/task | sort -n | sed -n 2p | xargs -I{} cat /proc/{}/timerslack_ns; cat /proc/self/timerslack_ns`)
		if out != "50000\n4000000\n50000\n" {
			t.Errorf("timer slack of the agent's main thread, of its sysmon thread, and of a root command: %q, want 50000, 4000000, 50000", out)
		}
		if out := d.Must("exec", "procs", "--", "cat", "/proc/self/timerslack_ns"); out != "50000\n" {
			t.Errorf("a command's timer slack: %q, want 50000", out)
		}
	})

	t.Run("tty", func(t *testing.T) {
		out := d.Must("exec", "-t", "procs", "--", "sh", "-c", "tty; test -t 1 && echo is-a-tty")
		if !strings.Contains(out, "/dev/pts/") || !strings.Contains(out, "is-a-tty") {
			t.Errorf("tty: %q", out)
		}
	})

	t.Run("detach attach", func(t *testing.T) {
		id := strings.TrimSpace(d.Must("exec", "--detach", "procs", "--", "sh", "-c", "echo one; sleep 2; echo two; exit 4"))
		if len(id) == 0 || strings.ContainsAny(id, " \n") {
			t.Fatalf("detach printed %q", id)
		}
		r := d.Carrel("attach", "procs", id)
		if r.Code != 4 || r.Stdout != "one\ntwo\n" {
			t.Errorf("attach: %+v", r)
		}
		if r := d.Carrel("attach", "procs", "0123456789abcdef"); r.Code == 0 {
			t.Errorf("attach to an unknown id: %+v", r)
		}
	})

	// A client killed while attached: the next attach gets the command,
	// its output from the start, however soon it comes.
	t.Run("attach after a killed client", func(t *testing.T) {
		id := strings.TrimSpace(d.Must("exec", "--detach", "procs", "--", "sh", "-c", "echo ready; sleep 3; echo end"))
		cmd := exec.Command(d.Bin+"/carrel", "attach", "procs", id)
		cmd.Env = append(cmd.Environ(), "CARREL_SOCKET="+d.Socket)
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		if line, err := bufio.NewReader(out).ReadString('\n'); line != "ready\n" {
			t.Fatalf("the first attach read %q, %v", line, err)
		}
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if r := d.Carrel("attach", "procs", id); r.Code != 0 || r.Stdout != "ready\nend\n" {
			t.Errorf("attach after the first client was killed: %+v", r)
		}
	})

	t.Run("ps kill", func(t *testing.T) {
		id := strings.TrimSpace(d.Must("exec", "--detach", "procs", "--", "sleep", "300"))
		var list struct {
			Processes []struct {
				Pid     int    `json:"pid"`
				Command string `json:"command"`
				ExecID  string `json:"execId"`
			} `json:"processes"`
		}
		if err := json.Unmarshal([]byte(d.Must("ps", "procs", "--output", "json")), &list); err != nil {
			t.Fatal(err)
		}
		pid := 0
		for _, p := range list.Processes {
			if p.ExecID == id && strings.Contains(p.Command, "sleep 300") {
				pid = p.Pid
			}
		}
		if pid == 0 {
			t.Fatalf("sleep 300 (exec %s) not in ps: %+v", id, list.Processes)
		}
		if out := d.Must("ps", "procs"); !strings.Contains(out, "sleep 300") || !strings.HasPrefix(out, "PID") {
			t.Errorf("ps table: %q", out)
		}
		d.Must("kill", "procs", strconv.Itoa(pid), "--signal", "KILL")
		r := d.Carrel("attach", "procs", id)
		if r.Code != 137 {
			t.Errorf("attach after kill: %+v", r)
		}
		if r := d.Carrel("kill", "procs", "1"); r.Code == 0 {
			t.Error("kill of pid 1 was allowed")
		}
	})

	t.Run("shell", func(t *testing.T) {
		if _, err := exec.LookPath("script"); err != nil {
			t.Skip("script (util-linux) is missing: cannot give carrel shell a terminal")
		}
		// script gives carrel a terminal; the shell's input is typed into it.
		cmd := exec.Command("script", "-qefc", d.Bin+"/carrel shell procs", "/dev/null")
		cmd.Env = append(cmd.Environ(), "CARREL_SOCKET="+d.Socket)
		cmd.Stdin = strings.NewReader("echo from-the-shell $((6*7)); id -un; exit 7\n")
		done := make(chan struct{})
		var out []byte
		var err error
		go func() { out, err = cmd.CombinedOutput(); close(done) }()
		select {
		case <-done:
		case <-time.After(60 * time.Second):
			cmd.Process.Kill()
			t.Fatal("carrel shell did not end")
		}
		if !strings.Contains(string(out), "from-the-shell 42") || !strings.Contains(string(out), "agent") {
			t.Errorf("shell output: %q", out)
		}
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 7 {
			t.Errorf("shell exit: %v", err)
		}
	})
	d.Must("vm", "rm", "--force", "procs")
}
