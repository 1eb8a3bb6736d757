package relay

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"net"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/policy"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/recorder"
)

// portWriter is a guest FileService whose Write takes the content from
// the data port, as the agent does, and keeps what it took.
type portWriter struct {
	bulkAgent
	guest net.Conn
	got   chan []byte
}

func (w *portWriter) Write(_ context.Context, s *connect.ClientStream[agentv1.WriteRequest]) (*connect.Response[agentv1.WriteResponse], error) {
	if !s.Receive() || s.Msg().GetHeader().GetBulkId() == 0 {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("want a header naming a transfer"))
	}
	fr := protocol.NewFrameReader(w.guest)
	var content []byte
	buf := make([]byte, protocol.MaxDataFrameBytes)
	for {
		f, _, err := fr.Next()
		if err != nil {
			return nil, err
		}
		if f.Flags&protocol.FrameAbort != 0 {
			return nil, connect.NewError(connect.CodeAborted, errors.New("the host gave the write up"))
		}
		b, err := fr.Payload(f, buf)
		if err != nil {
			return nil, err
		}
		content = append(content, b...)
		if f.Flags&protocol.FrameEnd != 0 {
			break
		}
	}
	for s.Receive() {
	}
	w.got <- content
	return connect.NewResponse(&agentv1.WriteResponse{Size: int64(len(content))}), nil
}

// An upload through the data port keeps its content in the audit log as
// a blob named by the digest the client gets, holding exactly what was
// sent, also when the upload before it was larger (the relay reuses its
// data buffer); an upload the client gives up keeps nothing.
func TestWriteBulkKeepsTheContent(t *testing.T) {
	agent := &portWriter{got: make(chan []byte, 1)}
	link, guest := bulkLinkTo(t, agent)
	agent.guest = guest
	dir := filepath.Join(t.TempDir(), "audit")
	log, err := audit.Open(dir, audit.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { log.Close() })
	r := New(Config{VMs: &fakeVMs{link: link}, Caller: func(context.Context) policy.Caller { return keyCaller },
		Recorder: recorder.New(log, nil)})
	_, h := agentv1connect.NewFileServiceHandler(r.Files(), connect.WithCodec(Codec{}))
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	files := agentv1connect.NewFileServiceClient(srv.Client(), srv.URL)

	upload := func(content []byte, commit bool) (*agentv1.WriteResponse, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		s := files.Write(ctx)
		s.RequestHeader().Set(protocol.VMHeader, testVM)
		s.Send(&agentv1.WriteRequest{Msg: &agentv1.WriteRequest_Header{Header: &agentv1.WriteHeader{Path: "/workspace/f"}}})
		for b := content; len(b) > 0; {
			n := min(len(b), 1<<20)
			s.Send(&agentv1.WriteRequest{Msg: &agentv1.WriteRequest_Data{Data: b[:n]}})
			b = b[n:]
		}
		if commit {
			s.Send(&agentv1.WriteRequest{Msg: &agentv1.WriteRequest_Commit{Commit: &agentv1.WriteCommit{}}})
		}
		resp, err := s.CloseAndReceive()
		if err != nil {
			return nil, err
		}
		return resp.Msg, nil
	}
	digest := func(b []byte) string {
		sum := sha256.Sum256(b)
		return "sha256:" + hex.EncodeToString(sum[:])
	}
	// The blob the latest write record names.
	lastBlob := func() []string {
		recs := auditRecords(dir, audit.KindFileOp)
		if len(recs) == 0 {
			t.Fatal("no file.op record")
		}
		return recs[len(recs)-1].Blobs
	}

	big := bytes.Repeat([]byte("0123456789abcdef"), (3<<20)/16+1) // over 3 MiB: four messages
	small := []byte("a small file")
	for _, content := range [][]byte{big, small} {
		resp, err := upload(content, true)
		if err != nil {
			t.Fatal(err)
		}
		if got := <-agent.got; !bytes.Equal(got, content) {
			t.Fatalf("the guest got %d bytes, want the %d sent", len(got), len(content))
		}
		if resp.Digest != digest(content) || resp.Size != int64(len(content)) {
			t.Fatalf("reply %s, %d bytes; want %s, %d", resp.Digest, resp.Size, digest(content), len(content))
		}
		blobs := lastBlob()
		if len(blobs) != 1 || blobs[0] != resp.Digest {
			t.Fatalf("write record names blobs %q, want [%s]", blobs, resp.Digest)
		}
		p, _ := audit.BlobPath(dir, blobs[0])
		if kept, err := os.ReadFile(p); err != nil || !bytes.Equal(kept, content) {
			t.Fatalf("the blob holds %d bytes (%v), want the %d sent", len(kept), err, len(content))
		}
	}

	gaveUp := []byte("never committed")
	if _, err := upload(gaveUp, false); connect.CodeOf(err) != connect.CodeAborted {
		t.Fatalf("an upload without its commit: %v, want Aborted", err)
	}
	if blobs := lastBlob(); len(blobs) != 0 {
		t.Errorf("the given-up write's record names blobs %q", blobs)
	}
	if p, _ := audit.BlobPath(dir, digest(gaveUp)); fileExists(p) {
		t.Error("the given-up write's content was kept")
	}
	if temps, _ := filepath.Glob(filepath.Join(dir, "blobs", ".put-*")); len(temps) != 0 {
		t.Errorf("temp files left: %q", temps)
	}
	rep, err := audit.Verify(dir, audit.VerifyOptions{})
	if err != nil || !rep.OK() {
		t.Errorf("verify: %v %+v", err, rep)
	}
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }
