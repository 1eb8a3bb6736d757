package tests

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/carrel-os/carrel/tests/harness"
)

// TestPortForward reaches TCP services inside a VM, which has no network
// interface but loopback, with `carrel port-forward`: an HTTP server, many
// connections at once, 16 MiB each way, half-closes, and the errors.
func TestPortForward(t *testing.T) {
	d := harness.New(t)
	d.Start()
	d.BuildImage()
	d.Must("vm", "create", "ports")

	// An HTTP server on the guest's loopback, serving a page and 16 MiB of
	// random bytes.
	d.Must("exec", "ports", "--", "sh", "-c",
		"mkdir -p /workspace/www && echo hello from the guest > /workspace/www/index.html && head -c 16777216 /dev/urandom > /workspace/www/blob")
	blobSum := strings.Fields(d.Must("exec", "ports", "--", "sha256sum", "/workspace/www/blob"))[0]
	d.Must("exec", "--detach", "ports", "--", "busybox", "httpd", "-f", "-p", "127.0.0.1:8080", "-h", "/workspace/www")
	// A one-shot sink: it stores what it receives and closes at our EOF.
	d.Must("exec", "--detach", "ports", "--", "sh", "-c", "busybox nc -l -p 9000 > /workspace/up")
	d.Must("exec", "ports", "--", "sh", "-c",
		"for i in $(seq 300); do netstat -ltn | grep -q ':8080 ' && netstat -ltn | grep -q ':9000 ' && exit 0; sleep 0.1; done; exit 1")

	// Port 9 has no listener.
	pf := startForward(t, d, "ports", "0:8080", "0:9000", "0:9")
	web, sink, nothing := pf.addrs[0], pf.addrs[1], pf.addrs[2]

	get := func(path string) ([]byte, error) {
		resp, err := http.Get("http://" + web + path)
		if err != nil {
			return nil, err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return nil, fmt.Errorf("status %s", resp.Status)
		}
		return io.ReadAll(resp.Body)
	}

	t.Run("http", func(t *testing.T) {
		body, err := get("/index.html")
		if err != nil || string(body) != "hello from the guest\n" {
			t.Fatalf("GET /index.html: %q, %v", body, err)
		}
	})

	t.Run("concurrent", func(t *testing.T) {
		var wg sync.WaitGroup
		for i := range 12 {
			wg.Go(func() {
				if i == 0 {
					body, err := get("/blob")
					if sum := sha256.Sum256(body); err != nil || hex.EncodeToString(sum[:]) != blobSum {
						t.Errorf("GET /blob alongside the others: %d bytes, %v", len(body), err)
					}
					return
				}
				body, err := get("/index.html")
				if err != nil || string(body) != "hello from the guest\n" {
					t.Errorf("GET %d: %q, %v", i, body, err)
				}
			})
		}
		wg.Wait()
	})

	t.Run("download 16MiB", func(t *testing.T) {
		start := time.Now()
		body, err := get("/blob")
		if err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(body)
		if len(body) != 16<<20 || hex.EncodeToString(sum[:]) != blobSum {
			t.Fatalf("got %d bytes with sha256 %x, want 16 MiB with %s", len(body), sum, blobSum)
		}
		t.Logf("16 MiB from the guest in %v", time.Since(start).Round(time.Millisecond))
	})

	t.Run("upload 16MiB and half-close", func(t *testing.T) {
		blob := make([]byte, 16<<20)
		rand.Read(blob)
		want := sha256.Sum256(blob)
		c, err := net.Dial("tcp", sink)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(3 * time.Minute))
		start := time.Now()
		if _, err := c.Write(blob); err != nil {
			t.Fatal(err)
		}
		// Our EOF reaches nc, which then exits and closes its side.
		if err := c.(*net.TCPConn).CloseWrite(); err != nil {
			t.Fatal(err)
		}
		if rest, err := io.ReadAll(c); err != nil || len(rest) != 0 {
			t.Fatalf("after the half-close: %q, %v", rest, err)
		}
		t.Logf("16 MiB to the guest in %v", time.Since(start).Round(time.Millisecond))
		out := d.Must("exec", "ports", "--", "sha256sum", "/workspace/up")
		if got := strings.Fields(out)[0]; got != hex.EncodeToString(want[:]) {
			t.Errorf("guest got sha256 %s, want %x", got, want)
		}
	})

	t.Run("nothing listening", func(t *testing.T) {
		c, err := net.Dial("tcp", nothing)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(time.Minute))
		if b, err := io.ReadAll(c); len(b) != 0 {
			t.Errorf("read %q, %v from a forward to a closed port", b, err)
		}
		deadline := time.Now().Add(10 * time.Second)
		for !strings.Contains(pf.stderr(), "refused") {
			if time.Now().After(deadline) {
				t.Fatalf("port-forward did not report the refused connection; stderr: %q", pf.stderr())
			}
			time.Sleep(50 * time.Millisecond)
		}
	})

	t.Run("bad arguments", func(t *testing.T) {
		for _, c := range []struct {
			args []string
			want string
		}{
			{[]string{"port-forward", "ghost", "0:80"}, "ghost"},
			{[]string{"port-forward", "ports", "80:0"}, "invalid remote port"},
			{[]string{"port-forward", "ports", "x:80"}, "invalid local port"},
			{[]string{"port-forward", "ports"}, "requires at least 2 arg"},
			{[]string{"port-forward", "--address", "not-an-ip", "ports", "0:80"}, "not an IP"},
		} {
			r := d.Carrel(c.args...)
			if r.Code == 0 || !strings.Contains(r.Stderr, c.want) {
				t.Errorf("carrel %v: exit %d, stderr %q; want an error with %q", c.args, r.Code, r.Stderr, c.want)
			}
		}
	})

	// The web server still answers after all that.
	if body, err := get("/index.html"); err != nil || string(body) != "hello from the guest\n" {
		t.Errorf("GET after the tests: %q, %v", body, err)
	}
	if code := pf.stop(); code != 0 {
		t.Errorf("port-forward exited %d after SIGINT; stderr: %s", code, pf.stderr())
	}
	d.Must("vm", "rm", "--force", "ports")
}

// forward is a running `carrel port-forward`.
type forward struct {
	cmd   *exec.Cmd
	addrs []string // the local addresses, in argument order
	mu    sync.Mutex
	errb  bytes.Buffer
	done  chan struct{}
}

func (f *forward) Write(p []byte) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.errb.Write(p)
}

func (f *forward) stderr() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.errb.String()
}

// stop interrupts it as ^C would and returns its exit code.
func (f *forward) stop() int {
	f.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-f.done:
	case <-time.After(10 * time.Second):
		f.cmd.Process.Kill()
		<-f.done
		return -1
	}
	return f.cmd.ProcessState.ExitCode()
}

var forwardingLine = regexp.MustCompile(`^forwarding (127\.0\.0\.1:\d+) -> (\S+):(\d+)$`)

// startForward runs `carrel port-forward vm specs...` and waits for its
// "forwarding" lines.
func startForward(t *testing.T, d *harness.Daemon, vm string, specs ...string) *forward {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	f := &forward{done: make(chan struct{})}
	f.cmd = exec.CommandContext(ctx, filepath.Join(d.Bin, "carrel"), append([]string{"port-forward", vm}, specs...)...)
	f.cmd.Env = append(os.Environ(), "CARREL_SOCKET="+d.Socket)
	f.cmd.Stderr = f
	out, err := f.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := f.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { f.cmd.Wait(); close(f.done) }()
	t.Cleanup(func() {
		cancel()
		<-f.done
	})
	lines := make(chan string)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	for _, spec := range specs {
		select {
		case line, ok := <-lines:
			m := forwardingLine.FindStringSubmatch(line)
			if !ok || m == nil || m[2] != vm || !strings.HasSuffix(spec, ":"+m[3]) {
				t.Fatalf("port-forward printed %q for %s; stderr: %s", line, spec, f.stderr())
			}
			f.addrs = append(f.addrs, m[1])
		case <-time.After(30 * time.Second):
			t.Fatalf("port-forward printed nothing for %s; stderr: %s", spec, f.stderr())
		}
	}
	go func() {
		for range lines {
		}
	}()
	return f
}
