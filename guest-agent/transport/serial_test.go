//go:build linux

package transport

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/guest-agent/server"
)

const portName = "org.carrel.agent.0"

// fakePorts lays out sysfs and /dev the way virtio_console does, with a
// decoy port and the one we want (vport0p2).
func fakePorts(t *testing.T) (sysDir, devDir string) {
	t.Helper()
	root := t.TempDir()
	sysDir, devDir = filepath.Join(root, "sys"), filepath.Join(root, "dev")
	for port, name := range map[string]string{"vport0p1": "org.qemu.guest_agent.0\n", "vport0p2": portName + "\n", "vport0p3": ""} {
		if err := os.MkdirAll(filepath.Join(sysDir, port), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(sysDir, port, "name"), []byte(name), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	os.MkdirAll(devDir, 0o755)
	for _, port := range []string{"vport0p1", "vport0p2", "vport0p3"} {
		if err := os.WriteFile(filepath.Join(devDir, port), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return sysDir, devDir
}

func TestFindPort(t *testing.T) {
	sysDir, devDir := fakePorts(t)
	got, err := findPort(sysDir, devDir, portName)
	if err != nil || got != filepath.Join(devDir, "vport0p2") {
		t.Fatalf("findPort = %q, %v", got, err)
	}
	if _, err := findPort(sysDir, devDir, "org.other"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("missing port: %v, want ErrNotFound", err)
	}
	if _, err := findPort(filepath.Join(sysDir, "nope"), devDir, portName); !errors.Is(err, ErrNotFound) {
		t.Fatalf("no sysfs dir: %v, want ErrNotFound", err)
	}
	os.Remove(filepath.Join(devDir, "vport0p2"))
	if _, err := findPort(sysDir, devDir, portName); !errors.Is(err, ErrNotFound) {
		t.Fatalf("no device node: %v, want ErrNotFound", err)
	}
}

// fakeDevice stands in for the port: each open makes a socketpair, keeps
// one end as the guest's fd and hands the other to the test as the host.
type fakeDevice struct {
	opens atomic.Int32
	hosts chan net.Conn
}

func newFakeDevice() *fakeDevice { return &fakeDevice{hosts: make(chan net.Conn, 4)} }

func (d *fakeDevice) open(path string) (int, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	f := os.NewFile(uintptr(fds[1]), "host")
	host, err := net.FileConn(f)
	f.Close()
	if err != nil {
		unix.Close(fds[0])
		return -1, err
	}
	d.opens.Add(1)
	d.hosts <- host
	return fds[0], nil
}

func (d *fakeDevice) host(t *testing.T) net.Conn {
	t.Helper()
	select {
	case c := <-d.hosts:
		t.Cleanup(func() { c.Close() })
		return c
	case <-time.After(5 * time.Second):
		t.Fatal("port was not opened")
		return nil
	}
}

func listen(t *testing.T, d *fakeDevice, waitHost func(int, <-chan struct{}) error) *serialListener {
	t.Helper()
	sysDir, devDir := fakePorts(t)
	if waitHost == nil {
		waitHost = func(int, <-chan struct{}) error { return nil }
	}
	l, err := listenSerial(portName, serialConfig{sysDir: sysDir, devDir: devDir, open: d.open, waitHost: waitHost})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

type acceptResult struct {
	c   net.Conn
	err error
}

func acceptAsync(l net.Listener) <-chan acceptResult {
	ch := make(chan acceptResult, 1)
	go func() {
		c, err := l.Accept()
		ch <- acceptResult{c, err}
	}()
	return ch
}

func TestSerialOneConnectionAtATime(t *testing.T) {
	d := newFakeDevice()
	l := listen(t, d, nil)

	c1, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	host1 := d.host(t)
	if c1.RemoteAddr().Network() != "virtio-serial" || c1.RemoteAddr().String() != portName {
		t.Errorf("remote addr %v/%v", c1.RemoteAddr().Network(), c1.RemoteAddr())
	}
	if _, err := host1.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := c1.Read(buf); err != nil || string(buf) != "ping" {
		t.Fatalf("read %q, %v", buf, err)
	}
	// Deadlines work: the fd is in the runtime poller.
	c1.SetReadDeadline(time.Now().Add(10 * time.Millisecond))
	if _, err := c1.Read(buf); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read past deadline: %v", err)
	}
	c1.SetReadDeadline(time.Time{})

	next := acceptAsync(l)
	select {
	case r := <-next:
		t.Fatalf("second Accept returned %v, %v while the first conn is open", r.c, r.err)
	case <-time.After(50 * time.Millisecond):
	}

	// The host goes away: the guest reads EOF and closes, as the HTTP/2
	// server does; then the port is opened again.
	host1.Close()
	if _, err := c1.Read(buf); err == nil {
		t.Fatal("read after host close succeeded")
	}
	c1.Close()
	c1.Close() // idempotent: must not release twice
	var c2 net.Conn
	select {
	case r := <-next:
		if r.err != nil {
			t.Fatal(r.err)
		}
		c2 = r.c
	case <-time.After(5 * time.Second):
		t.Fatal("Accept did not return after the conn closed")
	}
	host2 := d.host(t)
	go c2.Write([]byte("pong"))
	if _, err := host2.Read(buf); err != nil || string(buf) != "pong" {
		t.Fatalf("host read %q, %v", buf, err)
	}

	// Close unblocks an Accept waiting for the slot.
	waiting := make(chan struct{}, 1)
	l.cfg.slotWait = func() { waiting <- struct{}{} }
	blocked := acceptAsync(l)
	select {
	case <-waiting:
	case r := <-blocked:
		t.Fatalf("Accept returned %v, %v before waiting for the slot", r.c, r.err)
	case <-time.After(5 * time.Second):
		t.Fatal("Accept did not begin to wait for the slot")
	}
	select {
	case r := <-blocked:
		t.Fatalf("Accept returned %v, %v while c2 holds the slot", r.c, r.err)
	case <-time.After(20 * time.Millisecond):
	}
	l.Close()
	select {
	case r := <-blocked:
		if !errors.Is(r.err, net.ErrClosed) {
			t.Fatalf("Accept after Close: %v, want net.ErrClosed", r.err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not unblock Accept")
	}
	c2.Close()
	if d.opens.Load() != 2 {
		t.Fatalf("%d opens, want 2", d.opens.Load())
	}
}

func TestSerialAcceptWaitsForHost(t *testing.T) {
	d := newFakeDevice()
	connected := make(chan struct{})
	l := listen(t, d, func(fd int, stop <-chan struct{}) error {
		select {
		case <-connected:
			return nil
		case <-stop:
			return net.ErrClosed
		}
	})
	res := acceptAsync(l)
	d.host(t)
	select {
	case r := <-res:
		t.Fatalf("Accept returned %v, %v before the host connected", r.c, r.err)
	case <-time.After(50 * time.Millisecond):
	}
	close(connected)
	r := <-res
	if r.err != nil {
		t.Fatal(r.err)
	}
	r.c.Close()

	// Close while waiting for the host: Accept fails with net.ErrClosed
	// and the slot is free again.
	connected = make(chan struct{})
	res = acceptAsync(l)
	d.host(t)
	l.Close()
	if r := <-res; !errors.Is(r.err, net.ErrClosed) {
		t.Fatalf("Accept: %v, want net.ErrClosed", r.err)
	}
	if len(l.slot) != 0 {
		t.Fatal("slot still held after a failed Accept")
	}
}

// TestWaitHostPoll checks the real wait against a socketpair: a connected
// peer passes at once; a closed peer shows POLLHUP, as a port with no host
// does, and the wait lasts until stop.
func TestWaitHostPoll(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fds[0])
	if err := waitHost(fds[0], nil); err != nil {
		t.Fatalf("connected peer: %v", err)
	}
	unix.Close(fds[1])
	stop := make(chan struct{})
	done := make(chan error, 1)
	go func() { done <- waitHost(fds[0], stop) }()
	select {
	case err := <-done:
		t.Fatalf("waitHost returned %v with the peer gone", err)
	case <-time.After(5 * hostPollEvery):
	}
	close(stop)
	if err := <-done; !errors.Is(err, net.ErrClosed) {
		t.Fatalf("waitHost after stop: %v, want net.ErrClosed", err)
	}
}

// TestSerialServesHTTP2AcrossReconnects runs the real agent server over the
// fake port: a host connects, calls, disconnects, and a new host (carreld
// restarted) connects and calls again.
func TestSerialServesHTTP2AcrossReconnects(t *testing.T) {
	d := newFakeDevice()
	l := listen(t, d, nil)
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- server.Serve(ctx, l, server.Config{Transport: Serial}) }()
	defer func() {
		cancel()
		<-served
	}()

	for i := range 3 {
		hc, tr := protocol.NewHTTPClient(func(ctx context.Context) (net.Conn, error) {
			select {
			case c := <-d.hosts:
				return c, nil
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		})
		client := agentv1connect.NewAgentServiceClient(hc, protocol.BaseURL, protocol.ClientOptions()...)
		cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
		resp, err := client.Health(cctx, connect.NewRequest(&agentv1.HealthRequest{}))
		ccancel()
		if err != nil {
			t.Fatalf("host %d: health: %v", i, err)
		}
		if resp.Msg.Transport != Serial {
			t.Fatalf("host %d: transport %q", i, resp.Msg.Transport)
		}
		tr.CloseIdleConnections() // the host goes away
	}
	if n := d.opens.Load(); n < 3 {
		t.Fatalf("%d opens, want at least 3", n)
	}
}
