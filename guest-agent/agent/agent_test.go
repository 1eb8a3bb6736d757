//go:build linux

package agent

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/guest-agent/sandbox"
	"github.com/carrel-os/carrel/guest-agent/transport"
)

func TestKnownTransport(t *testing.T) {
	for _, name := range []string{"", Auto, transport.Vsock, "serial", transport.Serial, transport.Unix} {
		if !KnownTransport(name) {
			t.Errorf("KnownTransport(%q) = false", name)
		}
	}
	if KnownTransport("tcp") {
		t.Error(`KnownTransport("tcp") = true`)
	}
}

func TestNewLoggerPrefixesEachRecord(t *testing.T) {
	var buf bytes.Buffer
	log := NewLogger(&buf)
	log.Info("starting", "pid1", false)
	log.Warn("again")
	lines := strings.Split(strings.TrimSuffix(buf.String(), "\n"), "\n")
	if len(lines) != 2 {
		t.Fatalf("got %d lines, want 2: %q", len(lines), buf.String())
	}
	for _, l := range lines {
		if !strings.HasPrefix(l, "carrel-agent: time=") {
			t.Errorf("line %q lacks the prefix", l)
		}
	}
	if !strings.Contains(lines[0], "msg=starting pid1=false") {
		t.Errorf("line %q lacks the record", lines[0])
	}
}

func TestListenUnix(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	sock := filepath.Join(t.TempDir(), "agent.sock")
	stale, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	stale.(*net.UnixListener).SetUnlinkOnClose(false)
	stale.Close()

	cfg := Config{Transport: transport.Unix, Listen: sock}
	l, name, err := listen(context.Background(), log, cfg)
	if err != nil {
		t.Fatalf("listen over a stale socket: %v", err)
	}
	l.Close()
	if name != transport.Unix {
		t.Errorf("name = %q, want %q", name, transport.Unix)
	}

	for _, cfg := range []Config{
		{Transport: transport.Unix, Listen: sock, PID1: true},
		{Transport: transport.Unix},
	} {
		if l, _, err := listen(context.Background(), log, cfg); err == nil {
			l.Close()
			t.Errorf("listen(%+v) = nil error, want one", cfg)
		}
	}
}

// Off the guest, serve wraps its listener, serves, and a Shutdown call
// ends it through powerOff's exit instead of powering off.
func TestServeOffGuestShutdownExits(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	sock := filepath.Join(t.TempDir(), "agent.sock")
	var wrapped atomic.Int32
	cfg := Config{
		Transport: transport.Unix,
		Listen:    sock,
		Logger:    log,
		WrapListener: func(l net.Listener, _ *slog.Logger) net.Listener {
			wrapped.Add(1)
			return l
		},
	}
	ctx, exit := context.WithCancel(context.Background())
	defer exit()
	off := func(reboot bool) { powerOff(log, false, false, reboot, exit) }
	errc := make(chan error, 1)
	go func() { errc <- serve(ctx, cfg, &sandbox.Guard{Log: log}, workspace{}, nil, nil, off) }()

	hc, tr := protocol.NewHTTPClient(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	})
	defer tr.CloseIdleConnections()
	client := agentv1connect.NewAgentServiceClient(hc, protocol.BaseURL, protocol.ClientOptions()...)
	deadline := time.Now().Add(10 * time.Second)
	for {
		res, err := client.Health(ctx, connect.NewRequest(&agentv1.HealthRequest{}))
		if err == nil {
			if got := res.Msg.GetTransport(); got != transport.Unix {
				t.Errorf("Health transport = %q, want %q", got, transport.Unix)
			}
			break
		}
		// The agent may not be listening yet: the socket appears at bind,
		// before listen, so only the deadline tells a failure.
		if time.Now().After(deadline) {
			t.Fatalf("Health: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if n := wrapped.Load(); n != 1 {
		t.Errorf("WrapListener called %d times, want 1", n)
	}
	if _, err := client.Shutdown(ctx, connect.NewRequest(&agentv1.ShutdownRequest{})); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	select {
	case err := <-errc:
		if err != nil {
			t.Errorf("serve = %v, want nil", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("serve did not return after Shutdown")
	}
	if ctx.Err() == nil {
		t.Error("Shutdown off the guest did not call exit")
	}
}
