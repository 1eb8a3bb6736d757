package relay

import (
	"path"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

func info(path string) *agentv1.FileInfo {
	return &agentv1.FileInfo{Path: path, Type: agentv1.FileType_FILE_TYPE_REGULAR, Mode: 0o644}
}

func event(op agentv1.WatchOp, p string) *agentv1.WatchEvent {
	return &agentv1.WatchEvent{Op: op, Path: p}
}

// FuzzCheckInfo feeds arbitrary guest bytes, decoded as a FileInfo, to the
// check every relayed file info passes: whatever it accepts must be sane.
func FuzzCheckInfo(f *testing.F) {
	for _, fi := range []*agentv1.FileInfo{info("/etc/hosts"), {Path: "/l", Type: agentv1.FileType_FILE_TYPE_SYMLINK, LinkTarget: "../x"}} {
		b, _ := proto.Marshal(fi)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var fi agentv1.FileInfo
		if proto.Unmarshal(b, &fi) != nil {
			return
		}
		if checkInfo(&fi) != nil {
			return
		}
		if !strings.HasPrefix(fi.Path, "/") || len(fi.Path) > MaxPathBytes || fi.Mode > 0o7777 || fi.Size < 0 ||
			fi.Type == agentv1.FileType_FILE_TYPE_UNSPECIFIED || strings.ContainsRune(fi.Path, 0) {
			t.Fatalf("accepted %v", &fi)
		}
	})
}

// FuzzPortCheck feeds arbitrary guest bytes, decoded as PortData, to the
// check every relayed message passes: whatever it passes on is a data
// chunk within the cap, or the one close.
func FuzzPortCheck(f *testing.F) {
	for _, m := range []*agentv1.PortData{
		{Msg: &agentv1.PortData_Data{Data: []byte("hello")}},
		{Msg: &agentv1.PortData_Close{Close: &agentv1.PortClose{}}},
		{Msg: &agentv1.PortData_Opened{Opened: &agentv1.PortOpened{}}},
		{Msg: &agentv1.PortData_Open{Open: &agentv1.PortOpen{Host: "::1", Port: 22}}},
	} {
		b, _ := proto.Marshal(m)
		f.Add(b, b)
	}
	f.Fuzz(func(t *testing.T, a, b []byte) {
		var chk portCheck
		closes := 0
		for _, raw := range [][]byte{a, b} {
			var m agentv1.PortData
			if proto.Unmarshal(raw, &m) != nil {
				return
			}
			out, err := chk.check(&m)
			if err != nil {
				return
			}
			switch o := out.Msg.(type) {
			case *agentv1.PortData_Close:
				closes++
			case *agentv1.PortData_Data:
				if closes > 0 || len(o.Data) > MaxPortChunk {
					t.Fatalf("passed %v", out)
				}
			default:
				t.Fatalf("passed %v", out)
			}
			if closes > 1 || len(out.ProtoReflect().GetUnknown()) > 0 {
				t.Fatalf("passed %v", out)
			}
		}
	})
}

func TestBucket(t *testing.T) {
	t0 := time.Unix(1000, 0)
	b := newBucket(10, 2*time.Second, t0) // 20 at most
	if !b.take(t0, 20) || b.take(t0, 1) {
		t.Fatal("a full bucket holds 20")
	}
	if !b.take(t0.Add(time.Second), 10) || b.take(t0.Add(time.Second), 1) {
		t.Fatal("a second refills 10")
	}
	if !b.take(t0.Add(time.Hour), 20) || b.take(t0.Add(time.Hour), 1) {
		t.Fatal("refills stop at the cap")
	}
	// Waiting on a client earns credit beyond the cap, kept by refills.
	b.credit(5 * time.Second)
	if !b.take(t0.Add(2*time.Hour), 50) || b.take(t0.Add(2*time.Hour), 1) {
		t.Fatal("credit beyond the cap was lost")
	}
}

// FuzzCheckWatch feeds arbitrary guest bytes, decoded as a WatchResponse,
// to the check every relayed watch message passes: whatever it accepts
// must be sane.
func FuzzCheckWatch(f *testing.F) {
	ok := &agentv1.WatchResponse{Dropped: 3, Events: []*agentv1.WatchEvent{
		event(agentv1.WatchOp_WATCH_OP_CREATE, "/w/a"),
		{Op: agentv1.WatchOp_WATCH_OP_RENAME, Path: "/w/b/c", OldPath: "/w/d", IsDir: true},
	}}
	bad := &agentv1.WatchResponse{Events: []*agentv1.WatchEvent{event(agentv1.WatchOp_WATCH_OP_DELETE, "/w/../x")}}
	for _, m := range []*agentv1.WatchResponse{ok, bad} {
		b, _ := proto.Marshal(m)
		f.Add(b, true)
		f.Add(b, false)
	}
	f.Fuzz(func(t *testing.T, b []byte, recursive bool) {
		var m agentv1.WatchResponse
		if proto.Unmarshal(b, &m) != nil {
			return
		}
		const root = "/w"
		if checkWatch(root, recursive, &m) != nil {
			return
		}
		if len(m.Events) > MaxWatchBatch {
			t.Fatalf("accepted %d events", len(m.Events))
		}
		sane := func(p string) bool {
			return len(p) <= MaxPathBytes && !strings.ContainsRune(p, 0) && path.Clean(p) == p &&
				(p == root || strings.HasPrefix(p, root+"/")) && (recursive || p == root || path.Dir(p) == root)
		}
		for _, e := range m.Events {
			rename := e.Op == agentv1.WatchOp_WATCH_OP_RENAME
			if !sane(e.Path) || (rename && !sane(e.OldPath)) || (!rename && e.OldPath != "") {
				t.Fatalf("accepted %v", e)
			}
			if _, known := agentv1.WatchOp_name[int32(e.Op)]; !known || e.Op == agentv1.WatchOp_WATCH_OP_UNSPECIFIED {
				t.Fatalf("accepted op %d", e.Op)
			}
		}
	})
}

func TestEventCheckRefusesBadEvents(t *testing.T) {
	bad := []*agentv1.ExecResponse{
		{},
		{Event: &agentv1.ExecResponse_Exit{}},
		{Event: &agentv1.ExecResponse_Exit{Exit: &agentv1.ExitStatus{Code: -1}}},
		{Event: &agentv1.ExecResponse_Exit{Exit: &agentv1.ExitStatus{Code: 256}}},
		{Event: &agentv1.ExecResponse_Exit{Exit: &agentv1.ExitStatus{Code: 9, Signal: strings.Repeat("S", 100)}}},
		{Event: &agentv1.ExecResponse_Exit{Exit: &agentv1.ExitStatus{Code: 9, Signal: "sig\x1b"}}},
		{Event: &agentv1.ExecResponse_Started{}},
		{Event: &agentv1.ExecResponse_Started{Started: &agentv1.Started{Pid: 7, Id: "../x"}}},
	}
	for _, ev := range bad {
		var chk eventCheck
		if err := chk.check(ev); connect.CodeOf(err) != connect.CodeDataLoss {
			t.Errorf("%v: %v", ev, err)
		}
	}
	var chk eventCheck
	for _, ev := range []*agentv1.ExecResponse{
		{Event: &agentv1.ExecResponse_Started{Started: &agentv1.Started{Pid: 7, Id: "e1"}}},
		{Event: &agentv1.ExecResponse_Stdout{Stdout: []byte("out")}},
		{Event: &agentv1.ExecResponse_Exit{Exit: &agentv1.ExitStatus{Code: 137, Signal: "SIGKILL"}}},
	} {
		if err := chk.check(ev); err != nil {
			t.Fatalf("%v: %v", ev, err)
		}
	}
	if res := chk.result(); res.ID != "e1" || res.Stdout != 3 || res.Exit.GetSignal() != "SIGKILL" || chk.end(nil) != nil {
		t.Errorf("result %+v", res)
	}
	if err := chk.check(&agentv1.ExecResponse{Event: &agentv1.ExecResponse_Stdout{}}); connect.CodeOf(err) != connect.CodeDataLoss {
		t.Errorf("an event after the exit: %v", err)
	}
	if err := new(eventCheck).end(nil); connect.CodeOf(err) != connect.CodeDataLoss {
		t.Errorf("a clean end without an exit: %v", err)
	}
}

// FuzzEventCheck feeds arbitrary guest bytes, decoded as two exec events,
// to the check every relayed event passes: it must never panic, and
// whatever it passes on must be well formed.
func FuzzEventCheck(f *testing.F) {
	for _, ev := range []*agentv1.ExecResponse{
		{Event: &agentv1.ExecResponse_Stdout{Stdout: []byte("out")}},
		{Event: &agentv1.ExecResponse_Exit{Exit: &agentv1.ExitStatus{Code: 3}}},
		{Event: &agentv1.ExecResponse_Started{Started: &agentv1.Started{Pid: 7, Id: "e1"}}},
	} {
		b, _ := proto.Marshal(ev)
		f.Add(b, b)
	}
	f.Fuzz(func(t *testing.T, a, b []byte) {
		var chk eventCheck
		exits := 0
		for _, raw := range [][]byte{a, b} {
			var ev agentv1.ExecResponse
			if proto.Unmarshal(raw, &ev) != nil {
				return
			}
			if chk.check(&ev) != nil {
				return
			}
			switch e := ev.Event.(type) {
			case nil:
				t.Fatal("passed an empty event")
			case *agentv1.ExecResponse_Exit:
				exits++
				if e.Exit == nil || e.Exit.Code < 0 || e.Exit.Code > 255 || !validSignalName(e.Exit.Signal) {
					t.Fatalf("passed exit %v", e.Exit)
				}
			case *agentv1.ExecResponse_Started:
				if e.Started.GetPid() <= 0 || len(e.Started.GetId()) == 0 {
					t.Fatalf("passed start %v", e.Started)
				}
			}
			if exits > 1 || (exits == 1 && !chk.exited) {
				t.Fatal("passed an event after the exit")
			}
		}
	})
}
