package api

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"os"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/audit"
	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/supervisor/driver/drivertest"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

// memFiles is a guest file service over a map: enough to write, read and
// remove.
type memFiles struct {
	agentv1connect.UnimplementedFileServiceHandler
	mu    sync.Mutex
	files map[string][]byte
}

func (m *memFiles) Write(_ context.Context, s *connect.ClientStream[agentv1.WriteRequest]) (*connect.Response[agentv1.WriteResponse], error) {
	var path string
	var buf bytes.Buffer
	committed := false
	for s.Receive() {
		switch x := s.Msg().Msg.(type) {
		case *agentv1.WriteRequest_Header:
			path = x.Header.Path
		case *agentv1.WriteRequest_Data:
			buf.Write(x.Data)
		case *agentv1.WriteRequest_Commit:
			committed = true
		}
	}
	if !committed {
		return nil, connect.NewError(connect.CodeAborted, io.ErrUnexpectedEOF)
	}
	m.mu.Lock()
	m.files[path] = buf.Bytes()
	m.mu.Unlock()
	return connect.NewResponse(&agentv1.WriteResponse{Size: int64(buf.Len())}), nil
}

func (m *memFiles) Read(_ context.Context, req *connect.Request[agentv1.ReadRequest], s *connect.ServerStream[agentv1.ReadResponse]) error {
	m.mu.Lock()
	b, ok := m.files[req.Msg.Path]
	m.mu.Unlock()
	if !ok {
		return connect.NewError(connect.CodeNotFound, os.ErrNotExist)
	}
	return s.Send(&agentv1.ReadResponse{Data: b})
}

func (m *memFiles) Remove(_ context.Context, req *connect.Request[agentv1.RemoveRequest]) (*connect.Response[agentv1.RemoveResponse], error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.files[req.Msg.Path]; !ok {
		return nil, connect.NewError(connect.CodeNotFound, os.ErrNotExist)
	}
	delete(m.files, req.Msg.Path)
	return connect.NewResponse(&agentv1.RemoveResponse{}), nil
}

// readLog returns every record of the log in dir.
func readLog(t *testing.T, dir string) []audit.Record {
	t.Helper()
	var recs []audit.Record
	if err := audit.Scan(dir, func(_ uint64, _ int64, payload []byte) error {
		r, err := audit.Decode(payload)
		recs = append(recs, r)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return recs
}

func blobBytes(t *testing.T, dir, digest string) []byte {
	t.Helper()
	p, err := audit.BlobPath(dir, digest)
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestSessionIsRecorded: a session's records carry its VM and session id,
// and hold what happened: lifecycle steps, every call, each decision, a
// command's output as blobs, and file writes with their content.
func TestSessionIsRecorded(t *testing.T) {
	sock, _, drv, _, alog := authzAPIWithAudit(t)
	ctx := context.Background()
	c := client.New(sock)
	files := &memFiles{files: map[string][]byte{}}
	drv.SetNext(drivertest.Behavior{Files: files})
	vmResp, err := c.VMs.CreateVM(ctx, connect.NewRequest(&apiv1.CreateVMRequest{Name: "a", Image: "dev"}))
	if err != nil {
		t.Fatal(err)
	}
	session := vmResp.Msg.Vm.Session
	if !strings.HasPrefix(session, "ses_") || len(session) != len("ses_")+16 {
		t.Fatalf("session %q", session)
	}
	// The fake agent echoes each argument on a line of stdout.
	s, err := c.VMs.Exec(ctx, connect.NewRequest(&apiv1.ExecRequest{Vm: "a", Argv: []string{"echo", "hello", "<b>"}}))
	if err != nil {
		t.Fatal(err)
	}
	for s.Receive() {
	}
	if err := s.Err(); err != nil {
		t.Fatal(err)
	}
	content := bytes.Repeat([]byte("carrel "), 1000)
	if _, err := c.Upload(ctx, "a", "/workspace/notes.txt", bytes.NewReader(content), 0o644); err != nil {
		t.Fatal(err)
	}
	var got bytes.Buffer
	if _, err := c.Download(ctx, "a", "/workspace/notes.txt", &got); err != nil || !bytes.Equal(got.Bytes(), content) {
		t.Fatalf("download: %v, %d bytes", err, got.Len())
	}
	rm := connect.NewRequest(&agentv1.RemoveRequest{Path: "/workspace/missing"})
	rm.Header().Set(protocol.VMHeader, "a")
	if _, err := c.Files.Remove(ctx, rm); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("remove of a missing file: %v", err)
	}
	if _, err := c.VMs.StopVM(ctx, connect.NewRequest(&apiv1.StopVMRequest{Name: "a"})); err != nil {
		t.Fatal(err)
	}
	dir := alog.Dir()
	alog.Close()

	recs := readLog(t, dir)
	kinds := map[string]int{}
	var lifecycle []string
	var calls []string
	var stdout []byte
	var intents = map[uint64]audit.Record{}
	created := false // the VM exists
	for _, r := range recs {
		kinds[r.Kind]++
		created = created || r.Kind == audit.KindVMLifecycle
		if created && r.VM == "a" && r.Session != session {
			t.Errorf("record %d (%s) has session %q, want %q", r.Seq, r.Kind, r.Session, session)
		}
		var d map[string]any
		if len(r.Data) > 0 {
			if err := json.Unmarshal(r.Data, &d); err != nil {
				t.Fatal(err)
			}
		}
		switch r.Kind {
		case audit.KindVMLifecycle:
			lifecycle = append(lifecycle, d["event"].(string))
			if d["image_digest"] == "" || !strings.HasPrefix(d["policy_revision"].(string), "sha256:") {
				t.Errorf("lifecycle record without image or policy revision: %s", r.Data)
			}
		case audit.KindAPICall:
			calls = append(calls, d["procedure"].(string)+" "+d["code"].(string))
			if d["decision"] == "" {
				t.Errorf("api call without its decision: %s", r.Data)
			}
		case audit.KindIntent:
			intents[r.Seq] = r
		case audit.KindExecOutput:
			if d["stream"] != "stdout" || r.Provenance != audit.Guest || len(r.Blobs) != 1 {
				t.Errorf("exec output: %+v %s", r, r.Data)
				continue
			}
			if _, ok := intents[uint64(d["exec"].(float64))]; !ok {
				t.Errorf("exec output names no intent: %s", r.Data)
			}
			stdout = append(stdout, blobBytes(t, dir, r.Blobs[0])...)
		case audit.KindFileOp:
			switch d["op"] {
			case "write":
				sum := sha256.Sum256(content)
				if d["digest"] != "sha256:"+hex.EncodeToString(sum[:]) || d["size"].(float64) != float64(len(content)) || len(r.Blobs) != 1 {
					t.Errorf("write record: %s %v", r.Data, r.Blobs)
				} else if !bytes.Equal(blobBytes(t, dir, r.Blobs[0]), content) {
					t.Error("the write's blob is not what was written")
				}
				if r.Intent == nil || !strings.Contains(string(intents[*r.Intent].Data), `"action":"file.write"`) {
					t.Errorf("write outcome without its intent: %+v", r)
				}
			case "read":
				if d["size"].(float64) != float64(len(content)) || r.Intent != nil {
					t.Errorf("read record: %s", r.Data)
				}
			case "remove":
				if d["error"] == nil || r.Intent == nil {
					t.Errorf("a failed remove is recorded with its error, after its intent: %s", r.Data)
				}
			}
		}
	}
	if string(stdout) != "echo\nhello\n<b>\n" {
		t.Errorf("recorded stdout %q", stdout)
	}
	if want := []string{"created", "starting", "started", "stopping", "stopped"}; strings.Join(lifecycle, ",") != strings.Join(want, ",") {
		t.Errorf("lifecycle %v, want %v", lifecycle, want)
	}
	for _, want := range []string{"/carrel.api.v1.VMService/CreateVM ok", "/carrel.api.v1.VMService/Exec ok",
		"/carrel.agent.v1.FileService/Write ok", "/carrel.agent.v1.FileService/Remove not_found", "/carrel.api.v1.VMService/StopVM ok"} {
		found := false
		for _, c := range calls {
			found = found || c == want
		}
		if !found {
			t.Errorf("no api.call %q in %v", want, calls)
		}
	}
	if kinds[audit.KindFileOp] != 3 || kinds[audit.KindPolicyDecision] < 6 {
		t.Errorf("record kinds %v", kinds)
	}
	rep, err := audit.Verify(dir, audit.VerifyOptions{})
	if err != nil || !rep.OK() {
		t.Errorf("verify: %v %+v", err, rep)
	}
}
