package relay

import (
	"context"
	"errors"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/agentlink"
)

// bulkAgent answers Health with a data port, and holds a Read open until
// the host gives it up, as a guest busy sending the content would.
type bulkAgent struct {
	agentv1connect.UnimplementedAgentServiceHandler
	agentv1connect.UnimplementedFileServiceHandler
}

func (bulkAgent) Health(context.Context, *connect.Request[agentv1.HealthRequest]) (*connect.Response[agentv1.HealthResponse], error) {
	return connect.NewResponse(&agentv1.HealthResponse{DataPort: true}), nil
}

func (bulkAgent) Read(ctx context.Context, req *connect.Request[agentv1.ReadRequest], _ *connect.ServerStream[agentv1.ReadResponse]) error {
	if req.Msg.Path == "/missing" {
		return connect.NewError(connect.CodeNotFound, errors.New("no such file"))
	}
	<-ctx.Done()
	return ctx.Err()
}

// bulkLink returns a ready link to a bulkAgent whose data port is a pipe,
// and the guest's end of that pipe.
func bulkLink(t *testing.T) (*agentlink.Link, net.Conn) {
	t.Helper()
	return bulkLinkTo(t, bulkAgent{})
}

// bulkLinkTo is bulkLink with files as the agent's FileService.
func bulkLinkTo(t *testing.T, files agentv1connect.FileServiceHandler) (*agentlink.Link, net.Conn) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "agent.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle(agentv1connect.NewAgentServiceHandler(bulkAgent{}))
	mux.Handle(agentv1connect.NewFileServiceHandler(files))
	srv := protocol.NewHTTPServer(mux)
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	link := agentlink.New(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}, nil)
	t.Cleanup(func() { link.Close() })
	host, guest := socketPair(t)
	link.UseDataPort(func(context.Context) (net.Conn, error) { return host, nil })
	if _, err := link.Health(context.Background()); err != nil {
		t.Fatal(err)
	}
	return link, guest
}

// socketPair returns the two ends of a unix stream socket pair, as a data
// port is on the host. (A net.Pipe would block a zero-length write until
// the other end reads, which a socket never does.)
func socketPair(t *testing.T) (net.Conn, net.Conn) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	var conns [2]net.Conn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "data port")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		conns[i] = c
	}
	return conns[0], conns[1]
}

// inbound starts a transfer from the guest on link's data port, under a
// context that ends with t, and closes it when t ends.
func inbound(t *testing.T, link *agentlink.Link) (context.Context, *agentlink.Inbound) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	in := link.ReceiveData(ctx)
	if in == nil {
		cancel()
		t.Fatal("no data port")
	}
	t.Cleanup(func() { in.Close(); cancel() })
	return ctx, in
}

// A read whose guest sends more on the data port than was asked for is
// refused as the guest's breach (DataLoss), not reported as the link
// breaking, and the link to the agent stays healthy: readBulk must not
// swap the real error for the cancelled call's.
func TestReadBulkKeepsTheRealError(t *testing.T) {
	link, guest := bulkLink(t)
	ctx, in := inbound(t, link)
	go func() {
		b := protocol.AppendFrame(nil, protocol.Frame{Flags: protocol.FrameEnd, ID: in.ID, Length: 10})
		guest.Write(append(b, "0123456789"...))
	}()
	c, done := link.Files()
	const asked = 5
	var total int64
	pass := func(b []byte) error {
		if total+int64(len(b)) > asked {
			return errGuest("sent more than the %d bytes asked for", asked)
		}
		total += int64(len(b))
		return nil
	}
	err := readBulk(ctx, link, c, done, &agentv1.ReadRequest{Path: "/f", Length: asked, BulkId: in.ID}, in, pass)
	if connect.CodeOf(err) != connect.CodeDataLoss || !strings.Contains(err.Error(), "more than the 5 bytes") {
		t.Errorf("got %v, want the guest's breach (DataLoss)", err)
	}
	if st, lerr := link.State(); st != agentlink.Ready {
		t.Errorf("the link is %v (%v) after a breach on the data port, want it ready", st, lerr)
	}
}

// A guest that refuses the read sends no frames: the client gets the
// guest's own error.
func TestReadBulkGuestRefusal(t *testing.T) {
	link, _ := bulkLink(t)
	ctx, in := inbound(t, link)
	c, done := link.Files()
	err := readBulk(ctx, link, c, done, &agentv1.ReadRequest{Path: "/missing", BulkId: in.ID}, in, func([]byte) error { return nil })
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("got %v, want the guest's NotFound", err)
	}
}
