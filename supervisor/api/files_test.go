package api

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"strings"
	"testing"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/supervisor/driver/drivertest"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

// hostileFiles breaks every rule a guest's file service can break.
type hostileFiles struct {
	agentv1connect.UnimplementedFileServiceHandler
}

func info(path string) *agentv1.FileInfo {
	return &agentv1.FileInfo{Path: path, Type: agentv1.FileType_FILE_TYPE_REGULAR, Mode: 0o644}
}

func (hostileFiles) Stat(_ context.Context, req *connect.Request[agentv1.StatRequest]) (*connect.Response[agentv1.StatResponse], error) {
	switch req.Msg.Path {
	case "/relative":
		return connect.NewResponse(&agentv1.StatResponse{Info: info("etc/passwd")}), nil
	case "/badmode":
		fi := info("/badmode")
		fi.Mode = 0o177777
		return connect.NewResponse(&agentv1.StatResponse{Info: fi}), nil
	case "/badtype":
		fi := info("/badtype")
		fi.Type = 99
		return connect.NewResponse(&agentv1.StatResponse{Info: fi}), nil
	case "/nil":
		return connect.NewResponse(&agentv1.StatResponse{}), nil
	}
	return connect.NewResponse(&agentv1.StatResponse{Info: info(req.Msg.Path)}), nil
}

func (hostileFiles) List(_ context.Context, req *connect.Request[agentv1.ListRequest], s *connect.ServerStream[agentv1.ListResponse]) error {
	for i := 0; i < 3; i++ {
		if err := s.Send(&agentv1.ListResponse{Entries: []*agentv1.FileInfo{info("/a"), info("/b")}}); err != nil {
			return err
		}
	}
	return nil
}

func (hostileFiles) Read(_ context.Context, req *connect.Request[agentv1.ReadRequest], s *connect.ServerStream[agentv1.ReadResponse]) error {
	return s.Send(&agentv1.ReadResponse{Data: []byte("far more than asked for")})
}

func (hostileFiles) Write(_ context.Context, s *connect.ClientStream[agentv1.WriteRequest]) (*connect.Response[agentv1.WriteResponse], error) {
	var path string
	var n int64
	for s.Receive() {
		if h := s.Msg().GetHeader(); h != nil {
			path = h.Path
		}
		n += int64(len(s.Msg().GetData()))
	}
	forged := "sha256:" + strings.Repeat("0", 64)
	if path == "/forged-digest" {
		return connect.NewResponse(&agentv1.WriteResponse{Size: n, Digest: forged}), nil
	}
	return connect.NewResponse(&agentv1.WriteResponse{Size: 999, Digest: forged}), nil
}

func (hostileFiles) MakeDir(context.Context, *connect.Request[agentv1.MakeDirRequest]) (*connect.Response[agentv1.MakeDirResponse], error) {
	err := connect.NewError(connect.CodeUnauthenticated, errors.New("\x1b[31mplease log in"))
	err.Meta().Set("X-Evil", "1")
	return nil, err
}

func TestFileRelayRejectsHostileReplies(t *testing.T) {
	sock, drv := serveAPIWith(t)
	drv.SetNext(drivertest.Behavior{Files: hostileFiles{}})
	c := client.New(sock)
	ctx := context.Background()
	if _, err := c.VMs.CreateVM(ctx, connect.NewRequest(&apiv1.CreateVMRequest{Name: "evil", Image: "dev"})); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"/relative", "/badmode", "/badtype", "/nil"} {
		if _, err := c.Stat(ctx, "evil", p); connect.CodeOf(err) != connect.CodeDataLoss {
			t.Errorf("stat %s: %v", p, err)
		}
	}
	if fi, err := c.Stat(ctx, "evil", "/fine"); err != nil || fi.Path != "/fine" {
		t.Errorf("valid stat: %v %v", fi, err)
	}

	ls, err := c.Files.List(ctx, forVM("evil", &agentv1.ListRequest{Path: "/", MaxEntries: 3}))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for ls.Receive() {
		n += len(ls.Msg().Entries)
	}
	if connect.CodeOf(ls.Err()) != connect.CodeDataLoss || n > 3 {
		t.Errorf("list over the limit: %d entries passed, err %v", n, ls.Err())
	}

	rd, err := c.Files.Read(ctx, forVM("evil", &agentv1.ReadRequest{Path: "/f", Length: 4}))
	if err != nil {
		t.Fatal(err)
	}
	for rd.Receive() {
		t.Errorf("relayed %q past the requested length", rd.Msg().Data)
	}
	if connect.CodeOf(rd.Err()) != connect.CodeDataLoss {
		t.Errorf("read over length: %v", rd.Err())
	}

	if _, err := c.Upload(ctx, "evil", "/f", bytes.NewReader([]byte("hello")), 0); connect.CodeOf(err) != connect.CodeDataLoss {
		t.Errorf("write with a lying reply: %v", err)
	}
	// The digest a client gets is carreld's, of the bytes it forwarded.
	hello := sha256.Sum256([]byte("hello"))
	if w, err := c.Upload(ctx, "evil", "/forged-digest", bytes.NewReader([]byte("hello")), 0); err != nil || w.Digest != "sha256:"+hex.EncodeToString(hello[:]) {
		t.Errorf("write digest came from the guest: %v %v", w, err)
	}

	_, err = c.Files.MakeDir(ctx, forVM("evil", &agentv1.MakeDirRequest{Path: "/d"}))
	var ce *connect.Error
	if !errors.As(err, &ce) || ce.Code() != connect.CodeInternal || strings.ContainsRune(ce.Message(), 0x1b) || ce.Meta().Get("X-Evil") != "" {
		t.Errorf("guest error passed through unsanitized: %v (meta %v)", err, ce.Meta())
	}
	// The VM's link survives application-level lies: they are the guest's
	// words, not a broken stream.
	if _, err := c.Stat(ctx, "evil", "/still-there"); err != nil {
		t.Errorf("after hostile replies: %v", err)
	}
}

func TestFileRelayNeedsAVM(t *testing.T) {
	c := client.New(serveAPI(t))
	ctx := context.Background()
	if _, err := c.Files.Stat(ctx, connect.NewRequest(&agentv1.StatRequest{Path: "/"})); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("no vm header: %v", err)
	}
	if _, err := c.Stat(ctx, "ghost", "/"); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("unknown vm: %v", err)
	}
	if _, err := c.Download(ctx, "ghost", "/x", io.Discard); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("download from unknown vm: %v", err)
	}
}

func forVM[T any](vm string, msg *T) *connect.Request[T] {
	req := connect.NewRequest(msg)
	req.Header().Set(protocol.VMHeader, vm)
	return req
}
