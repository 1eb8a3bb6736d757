//go:build linux

package files

import (
	"os"
	"path/filepath"
	"testing"

	"connectrpc.com/connect"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

func TestWatchOverConnect(t *testing.T) {
	c := serve(t, Options{})
	dir := t.TempDir()
	ctx := callCtx(t)
	s, err := c.Watch(ctx, connect.NewRequest(&agentv1.WatchRequest{Path: dir + "/sub/..", Recursive: true}))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if !s.Receive() {
		t.Fatalf("no first message: %v", s.Err())
	}
	if n := len(s.Msg().Events); n != 0 {
		t.Fatalf("first message has %d events", n)
	}
	mustWrite(t, filepath.Join(dir, "a"), "x")
	// A name that is not UTF-8 arrives with "?" for the bad bytes.
	if err := os.WriteFile(filepath.Join(dir, "bad\xffname"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(dir, "a"), filepath.Join(dir, "b")); err != nil {
		t.Fatal(err)
	}
	want := []*agentv1.WatchEvent{
		{Op: agentv1.WatchOp_WATCH_OP_CREATE, Path: dir + "/a"},
		{Op: agentv1.WatchOp_WATCH_OP_MODIFY, Path: dir + "/a"},
		{Op: agentv1.WatchOp_WATCH_OP_CREATE, Path: dir + "/bad?name"},
		{Op: agentv1.WatchOp_WATCH_OP_RENAME, Path: dir + "/b", OldPath: dir + "/a"},
	}
	var got []*agentv1.WatchEvent
	for len(got) < len(want) && s.Receive() {
		got = append(got, s.Msg().Events...)
	}
	if len(got) != len(want) {
		t.Fatalf("got %v (err %v), want %v", got, s.Err(), want)
	}
	for i, e := range got {
		w := want[i]
		if e.Op != w.Op || e.Path != w.Path || e.OldPath != w.OldPath || e.IsDir || e.TimeUnixNano == 0 {
			t.Errorf("event %d = %v, want %v", i, e, w)
		}
	}
}

func TestWatchErrors(t *testing.T) {
	c := serve(t, Options{})
	dir := t.TempDir()
	mustWrite(t, filepath.Join(dir, "file"), "")
	for _, tc := range []struct {
		path string
		code connect.Code
		msg  string
	}{
		{"relative", connect.CodeInvalidArgument, "not absolute"},
		{dir + "/missing", connect.CodeNotFound, "watch " + dir + "/missing: no such file"},
		{dir + "/file", connect.CodeFailedPrecondition, "not a directory"},
	} {
		s, err := c.Watch(callCtx(t), connect.NewRequest(&agentv1.WatchRequest{Path: tc.path}))
		if err == nil {
			for s.Receive() {
				t.Errorf("watch %s: got %v", tc.path, s.Msg())
			}
			err = s.Err()
		}
		wantErr(t, err, tc.code, tc.msg)
	}
}
