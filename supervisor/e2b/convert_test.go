package e2b

import (
	"encoding/base64"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"path"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	filesystempb "github.com/carrel-os/carrel/supervisor/gen/envdpb/filesystem"
	processpb "github.com/carrel-os/carrel/supervisor/gen/envdpb/process"
)

func TestEndEvent(t *testing.T) {
	tests := []struct {
		x    *agentv1.ExitStatus
		want *processpb.ProcessEvent_EndEvent
	}{
		{&agentv1.ExitStatus{}, &processpb.ProcessEvent_EndEvent{ExitCode: 0, Exited: true, Status: "exit status 0"}},
		{&agentv1.ExitStatus{Code: 3}, &processpb.ProcessEvent_EndEvent{ExitCode: 3, Exited: true, Status: "exit status 3"}},
		{&agentv1.ExitStatus{Code: 255}, &processpb.ProcessEvent_EndEvent{ExitCode: 255, Exited: true, Status: "exit status 255"}},
		// A signal: as Go's os.ProcessState says it, whatever code the
		// agent gave with it.
		{&agentv1.ExitStatus{Code: 137, Signal: "SIGKILL"}, &processpb.ProcessEvent_EndEvent{ExitCode: -1, Exited: false, Status: "signal: killed"}},
		{&agentv1.ExitStatus{Signal: "SIGTERM"}, &processpb.ProcessEvent_EndEvent{ExitCode: -1, Exited: false, Status: "signal: terminated"}},
		{&agentv1.ExitStatus{Code: 130, Signal: "SIGINT"}, &processpb.ProcessEvent_EndEvent{ExitCode: -1, Exited: false, Status: "signal: interrupt"}},
		// A name Go does not know is given as it came.
		{&agentv1.ExitStatus{Signal: "SIGRTMIN+3"}, &processpb.ProcessEvent_EndEvent{ExitCode: -1, Exited: false, Status: "signal: SIGRTMIN+3"}},
	}
	for _, tt := range tests {
		if got := endEvent(tt.x); !proto.Equal(got, tt.want) {
			t.Errorf("endEvent(%v) = %v, want %v", tt.x, got, tt.want)
		}
	}
}

func watch(evs ...*agentv1.WatchEvent) *agentv1.WatchResponse {
	return &agentv1.WatchResponse{Events: evs}
}

func wev(op agentv1.WatchOp, p, old string) *agentv1.WatchEvent {
	return &agentv1.WatchEvent{Op: op, Path: p, OldPath: old}
}

// fsEvents writes envd events as "TYPE name" lines, for comparison.
func fsEvents(evs []*filesystempb.FilesystemEvent) string {
	var b strings.Builder
	for _, e := range evs {
		b.WriteString(strings.TrimPrefix(e.Type.String(), "EVENT_TYPE_") + " " + e.Name + "\n")
	}
	return b.String()
}

func TestEvents(t *testing.T) {
	const (
		create = agentv1.WatchOp_WATCH_OP_CREATE
		modify = agentv1.WatchOp_WATCH_OP_MODIFY
		del    = agentv1.WatchOp_WATCH_OP_DELETE
		rename = agentv1.WatchOp_WATCH_OP_RENAME
	)
	tmp := "/w/" + writeTempPrefix + "a1b2"
	tests := []struct {
		name string
		dir  string
		m    *agentv1.WatchResponse
		want string
	}{
		{"each op", "/w", watch(
			wev(create, "/w/a", ""),
			wev(modify, "/w/a", ""),
			wev(del, "/w/a", ""),
			wev(rename, "/w/c", "/w/b"),
		), "CREATE a\nWRITE a\nREMOVE a\nRENAME b\nCREATE c\n"},
		{"names relative to the directory", "/w", watch(
			wev(create, "/w/d/e/f", ""),
			wev(rename, "/w/x/y", "/w/d/e/f"),
		), "CREATE d/e/f\nRENAME d/e/f\nCREATE x/y\n"},
		{"a directory given with a slash", "/w/", watch(wev(create, "/w/d/f", "")), "CREATE d/f\n"},
		{"the root", "/", watch(wev(create, "/etc/x", "")), "CREATE etc/x\n"},
		{"a path outside: its base name", "/w", watch(wev(create, "/wx/y", "")), "CREATE y\n"},
		{"the agent's write: its temp file hidden, its rename a create and a write", "/w", watch(
			wev(create, tmp, ""),
			wev(modify, tmp, ""),
			wev(rename, "/w/file.txt", tmp),
		), "CREATE file.txt\nWRITE file.txt\n"},
		{"a write in a subdirectory", "/w", watch(
			wev(create, "/w/sub/"+writeTempPrefix+"zz", ""),
			wev(rename, "/w/sub/f", "/w/sub/"+writeTempPrefix+"zz"),
		), "CREATE sub/f\nWRITE sub/f\n"},
		{"a temp file removed", "/w", watch(wev(del, tmp, "")), ""},
		{"a temp file renamed to another", "/w", watch(wev(rename, "/w/"+writeTempPrefix+"b", tmp)), ""},
		{"a file named like the prefix, not starting with it", "/w", watch(wev(create, "/w/x"+writeTempPrefix, "")), "CREATE x" + writeTempPrefix + "\n"},
		{"an unknown op", "/w", watch(wev(agentv1.WatchOp_WATCH_OP_UNSPECIFIED, "/w/a", ""), wev(agentv1.WatchOp(99), "/w/b", ""), wev(create, "/w/c", "")), "CREATE c\n"},
		{"nothing", "/w", watch(), ""},
	}
	for _, tt := range tests {
		if got := fsEvents(events(tt.dir, tt.m)); got != tt.want {
			t.Errorf("%s:\n%s\nwant\n%s", tt.name, got, tt.want)
		}
	}
}

// FuzzEvents feeds arbitrary watch replies, decoded from bytes, to the
// translation: it must not panic, never show the agent's temp files, emit
// only the event types envd has, and at most two events for each of
// carrel's.
func FuzzEvents(f *testing.F) {
	for _, m := range []*agentv1.WatchResponse{
		watch(wev(agentv1.WatchOp_WATCH_OP_CREATE, "/w/a", "")),
		watch(wev(agentv1.WatchOp_WATCH_OP_RENAME, "/w/a", "/w/"+writeTempPrefix+"x"), wev(agentv1.WatchOp_WATCH_OP_MODIFY, "/w/"+writeTempPrefix+"x", "")),
		watch(wev(agentv1.WatchOp_WATCH_OP_RENAME, "/w/b", "/w/a"), wev(agentv1.WatchOp_WATCH_OP_DELETE, "/elsewhere", "")),
	} {
		b, _ := proto.Marshal(m)
		f.Add("/w", b)
	}
	f.Fuzz(func(t *testing.T, dir string, b []byte) {
		var m agentv1.WatchResponse
		if proto.Unmarshal(b, &m) != nil {
			return
		}
		out := events(dir, &m)
		if len(out) > 2*len(m.Events) {
			t.Fatalf("%d events from %d", len(out), len(m.Events))
		}
		for _, e := range out {
			if strings.HasPrefix(path.Base(e.Name), writeTempPrefix) {
				t.Fatalf("a temp file shown: %v", e)
			}
			switch e.Type {
			case filesystempb.EventType_EVENT_TYPE_CREATE, filesystempb.EventType_EVENT_TYPE_WRITE,
				filesystempb.EventType_EVENT_TYPE_REMOVE, filesystempb.EventType_EVENT_TYPE_RENAME:
			default:
				t.Fatalf("event type %v", e.Type)
			}
		}
	})
}

func TestEntry(t *testing.T) {
	mtime := time.Date(2026, 11, 27, 8, 0, 0, 123, time.UTC)
	target := "../x"
	tests := []struct {
		name string
		fi   *agentv1.FileInfo
		want *filesystempb.EntryInfo
	}{
		{"a file", &agentv1.FileInfo{Path: "/workspace/a.txt", Type: agentv1.FileType_FILE_TYPE_REGULAR, Mode: 0o644, Size: 5, Uid: 1000, Gid: 1000, MtimeUnixNano: mtime.UnixNano()},
			&filesystempb.EntryInfo{Name: "a.txt", Path: "/workspace/a.txt", Type: filesystempb.FileType_FILE_TYPE_FILE, Size: 5, Mode: 0o644, Permissions: "-rw-r--r--", Owner: "agent", Group: "agent"}},
		{"a directory", &agentv1.FileInfo{Path: "/etc", Type: agentv1.FileType_FILE_TYPE_DIRECTORY, Mode: 0o755, Size: 4096, MtimeUnixNano: mtime.UnixNano()},
			&filesystempb.EntryInfo{Name: "etc", Path: "/etc", Type: filesystempb.FileType_FILE_TYPE_DIRECTORY, Size: 4096, Mode: uint32(fs.ModeDir | 0o755), Permissions: "drwxr-xr-x", Owner: "root", Group: "root"}},
		{"a symlink", &agentv1.FileInfo{Path: "/w/l", Type: agentv1.FileType_FILE_TYPE_SYMLINK, Mode: 0o777, LinkTarget: target, Uid: 1234, Gid: 5678, MtimeUnixNano: mtime.UnixNano()},
			&filesystempb.EntryInfo{Name: "l", Path: "/w/l", Type: filesystempb.FileType_FILE_TYPE_SYMLINK, Mode: uint32(fs.ModeSymlink | 0o777), Permissions: "Lrwxrwxrwx", Owner: "1234", Group: "5678", SymlinkTarget: &target}},
		{"setuid", &agentv1.FileInfo{Path: "/bin/su", Type: agentv1.FileType_FILE_TYPE_REGULAR, Mode: 0o4755, MtimeUnixNano: mtime.UnixNano()},
			&filesystempb.EntryInfo{Name: "su", Path: "/bin/su", Type: filesystempb.FileType_FILE_TYPE_FILE, Mode: uint32(fs.ModeSetuid | 0o755), Permissions: "urwxr-xr-x", Owner: "root", Group: "root"}},
		{"setgid", &agentv1.FileInfo{Path: "/x", Type: agentv1.FileType_FILE_TYPE_REGULAR, Mode: 0o2750, MtimeUnixNano: mtime.UnixNano()},
			&filesystempb.EntryInfo{Name: "x", Path: "/x", Type: filesystempb.FileType_FILE_TYPE_FILE, Mode: uint32(fs.ModeSetgid | 0o750), Permissions: "grwxr-x---", Owner: "root", Group: "root"}},
		{"a sticky directory", &agentv1.FileInfo{Path: "/tmp", Type: agentv1.FileType_FILE_TYPE_DIRECTORY, Mode: 0o1777, MtimeUnixNano: mtime.UnixNano()},
			&filesystempb.EntryInfo{Name: "tmp", Path: "/tmp", Type: filesystempb.FileType_FILE_TYPE_DIRECTORY, Mode: uint32(fs.ModeDir | fs.ModeSticky | 0o777), Permissions: "dtrwxrwxrwx", Owner: "root", Group: "root"}},
		{"type bits in the mode are dropped", &agentv1.FileInfo{Path: "/f", Type: agentv1.FileType_FILE_TYPE_REGULAR, Mode: 0o100600, MtimeUnixNano: mtime.UnixNano()},
			&filesystempb.EntryInfo{Name: "f", Path: "/f", Type: filesystempb.FileType_FILE_TYPE_FILE, Mode: 0o600, Permissions: "-rw-------", Owner: "root", Group: "root"}},
		{"something else is a file", &agentv1.FileInfo{Path: "/dev/null", Type: agentv1.FileType_FILE_TYPE_OTHER, Mode: 0o666, MtimeUnixNano: mtime.UnixNano()},
			&filesystempb.EntryInfo{Name: "null", Path: "/dev/null", Type: filesystempb.FileType_FILE_TYPE_FILE, Mode: 0o666, Permissions: "-rw-rw-rw-", Owner: "root", Group: "root"}},
	}
	for _, tt := range tests {
		got := entry(tt.fi)
		if !got.ModifiedTime.AsTime().Equal(mtime) {
			t.Errorf("%s: modified %v, want %v", tt.name, got.ModifiedTime.AsTime(), mtime)
		}
		got.ModifiedTime = nil
		if !proto.Equal(got, tt.want) {
			t.Errorf("%s:\n got %v\nwant %v", tt.name, got, tt.want)
		}
		if fs.FileMode(got.Mode).String() != got.Permissions {
			t.Errorf("%s: permissions %q are not the mode's %q", tt.name, got.Permissions, fs.FileMode(got.Mode))
		}
	}
}

func TestResolve(t *testing.T) {
	for in, want := range map[string]string{
		"":              "",
		"/":             "/",
		"/etc/hosts":    "/etc/hosts",
		"/a/../b":       "/a/../b", // absolute paths go as they came: the guest checks them
		"a.txt":         Workdir + "/a.txt",
		"d/e/":          Workdir + "/d/e",
		".":             Workdir,
		"./x":           Workdir + "/x",
		"a/../b":        Workdir + "/b",
		"../etc/passwd": "/etc/passwd", // out of the workspace, and absolute: the policy decides
	} {
		if got := resolve(in); got != want {
			t.Errorf("resolve(%q) = %q, want %q", in, got, want)
		}
	}
}

func basic(s string) http.Header {
	h := http.Header{}
	h.Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(s)))
	return h
}

func TestUserOf(t *testing.T) {
	good := []struct {
		h    http.Header
		want string
	}{
		{http.Header{}, defaultUser},
		{basic("root:"), "root"},
		{basic("agent:"), "agent"},
		{basic("agent"), "agent"},
		{basic("agent:secret:more"), "agent"},
		{basic(":"), ""},
		{basic(strings.Repeat("u", 255) + ":"), strings.Repeat("u", 255)},
	}
	for _, tt := range good {
		got, err := userOf(tt.h)
		if err != nil || got != tt.want {
			t.Errorf("%q: %q, %v; want %q", tt.h.Get("Authorization"), got, err, tt.want)
		}
	}
	bad := []string{
		"Bearer " + base64.StdEncoding.EncodeToString([]byte("root:")),
		"basic " + base64.StdEncoding.EncodeToString([]byte("root:")),
		"Basic",
		"Basic !!!",
		"Basic cm9vdDo", // unpadded
		"Basic " + base64.URLEncoding.EncodeToString([]byte("\xfb\xff:")),
		"Basic " + base64.StdEncoding.EncodeToString([]byte(strings.Repeat("u", 257))),
	}
	for _, auth := range bad {
		h := http.Header{}
		h.Set("Authorization", auth)
		if got, err := userOf(h); connect.CodeOf(err) != connect.CodeInvalidArgument || got != "" {
			t.Errorf("%q: %q, %v; want invalid_argument", auth, got, err)
		}
	}
}

// FuzzUserOf: whatever the Authorization header, userOf does not panic,
// and a user it reads came from a Basic header's base64 and holds no
// colon.
func FuzzUserOf(f *testing.F) {
	f.Add("Basic " + base64.StdEncoding.EncodeToString([]byte("root:")))
	f.Add("Basic " + base64.StdEncoding.EncodeToString([]byte("a:b")))
	f.Add("Bearer x")
	f.Add("Basic ===")
	f.Fuzz(func(t *testing.T, auth string) {
		h := http.Header{}
		h["Authorization"] = []string{auth}
		user, err := userOf(h)
		if err != nil {
			if connect.CodeOf(err) != connect.CodeInvalidArgument || user != "" {
				t.Fatalf("%q: %q, %v", auth, user, err)
			}
			return
		}
		if auth == "" {
			if user != defaultUser {
				t.Fatalf("no header: %q", user)
			}
			return
		}
		enc, ok := strings.CutPrefix(auth, "Basic ")
		b, derr := base64.StdEncoding.DecodeString(enc)
		if !ok || derr != nil || len(b) > 256 || strings.Contains(user, ":") || !strings.HasPrefix(string(b), user) {
			t.Fatalf("%q read as user %q", auth, user)
		}
	})
}

func TestDecodeJSON(t *testing.T) {
	type body struct {
		TemplateID string `json:"templateID"`
		Timeout    int    `json:"timeout"`
	}
	req := func(s string) *http.Request {
		return httptest.NewRequest(http.MethodPost, "/sandboxes", strings.NewReader(s))
	}
	for _, empty := range []string{"", " ", "\n\t "} {
		v := body{TemplateID: "kept"}
		if err := decodeJSON(req(empty), &v); err != nil || v.TemplateID != "kept" {
			t.Errorf("%q: %+v, %v", empty, v, err)
		}
	}
	var v body
	if err := decodeJSON(req(`{"templateID":"base","timeout":30,"unknown":1}`), &v); err != nil || v.TemplateID != "base" || v.Timeout != 30 {
		t.Errorf("good body: %+v, %v", v, err)
	}
	// Exactly the cap: read.
	full := `{"templateID":"x"}` + strings.Repeat(" ", maxJSONBody-len(`{"templateID":"x"}`))
	if err := decodeJSON(req(full), &v); err != nil || v.TemplateID != "x" {
		t.Errorf("a body of %d bytes: %+v, %v", len(full), v, err)
	}
	bad := []struct {
		name, body, want string
	}{
		{"one byte over the cap", full + " ", "over"},
		{"far over the cap", strings.Repeat("x", 4*maxJSONBody), "over"},
		{"malformed", `{"templateID":`, "malformed JSON"},
		{"a syntax error", `{"templateID" "x"}`, "malformed JSON at byte"},
		{"the wrong type", `{"timeout":"soon"}`, "malformed JSON"},
		{"not an object", `[1,2]`, "malformed JSON"},
		{"trailing garbage", `{} x`, "malformed JSON"},
	}
	for _, tt := range bad {
		if err := decodeJSON(req(tt.body), &v); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: %v, want %q", tt.name, err, tt.want)
		}
	}
}

func TestHTTPStatus(t *testing.T) {
	for code, want := range map[connect.Code]int{
		connect.CodeInvalidArgument:    http.StatusBadRequest,
		connect.CodeOutOfRange:         http.StatusBadRequest,
		connect.CodeUnauthenticated:    http.StatusUnauthorized,
		connect.CodePermissionDenied:   http.StatusForbidden,
		connect.CodeNotFound:           http.StatusNotFound,
		connect.CodeAlreadyExists:      http.StatusConflict,
		connect.CodeFailedPrecondition: http.StatusConflict,
		connect.CodeAborted:            http.StatusConflict,
		connect.CodeResourceExhausted:  http.StatusTooManyRequests,
		connect.CodeUnavailable:        http.StatusServiceUnavailable,
		connect.CodeDeadlineExceeded:   http.StatusGatewayTimeout,
		connect.CodeInternal:           http.StatusInternalServerError,
		connect.CodeUnknown:            http.StatusInternalServerError,
		connect.CodeDataLoss:           http.StatusInternalServerError,
		connect.CodeCanceled:           http.StatusInternalServerError,
		connect.CodeUnimplemented:      http.StatusInternalServerError,
		0:                              http.StatusInternalServerError,
	} {
		if got := httpStatus(code); got != want {
			t.Errorf("httpStatus(%v) = %d, want %d", code, got, want)
		}
	}
}
