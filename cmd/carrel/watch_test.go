package main

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

func TestPrintWatchEvent(t *testing.T) {
	for _, c := range []struct {
		e    *agentv1.WatchEvent
		want string
	}{
		{&agentv1.WatchEvent{Op: agentv1.WatchOp_WATCH_OP_CREATE, Path: "/w/a"}, "CREATE /w/a\n"},
		{&agentv1.WatchEvent{Op: agentv1.WatchOp_WATCH_OP_DELETE, Path: "/w/d", IsDir: true}, "DELETE /w/d/\n"},
		{&agentv1.WatchEvent{Op: agentv1.WatchOp_WATCH_OP_RENAME, Path: "/w/new", OldPath: "/w/old"}, "RENAME /w/old -> /w/new\n"},
		// A name cannot break the line or drive the terminal.
		{&agentv1.WatchEvent{Op: agentv1.WatchOp_WATCH_OP_MODIFY, Path: "/w/a\nCREATE /etc\x1b[2J"}, "MODIFY \"/w/a\\nCREATE /etc\\x1b[2J\"\n"},
	} {
		var b bytes.Buffer
		if err := printWatchEvent(&b, c.e, false); err != nil || b.String() != c.want {
			t.Errorf("%v printed %q (%v), want %q", c.e, b.String(), err, c.want)
		}
	}
	var b bytes.Buffer
	printWatchEvent(&b, &agentv1.WatchEvent{Op: agentv1.WatchOp_WATCH_OP_RENAME, Path: "/b", OldPath: "/a", TimeUnixNano: 42}, true)
	var got map[string]any
	if err := json.Unmarshal(b.Bytes(), &got); err != nil || bytes.Count(b.Bytes(), []byte("\n")) != 1 {
		t.Fatalf("json line %q: %v", b.String(), err)
	}
	if got["op"] != "WATCH_OP_RENAME" || got["path"] != "/b" || got["oldPath"] != "/a" || got["isDir"] != false || got["timeUnixNano"] != "42" {
		t.Errorf("json %v", got)
	}
}
