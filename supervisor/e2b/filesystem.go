package e2b

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/supervisor/client"
	filesystempb "github.com/carrel-os/carrel/supervisor/gen/envdpb/filesystem"
	"github.com/carrel-os/carrel/supervisor/gen/envdpb/filesystem/filesystempbconnect"
)

// Workdir is where relative paths resolve and commands start by default:
// carrel's workspace, the part of a VM that is its own and survives a
// stop (e2b's is the user's home).
const Workdir = "/workspace"

// resolve makes a client's path absolute; "" stays "" (the default).
func resolve(p string) string {
	if p == "" || strings.HasPrefix(p, "/") {
		return p
	}
	return path.Join(Workdir, p)
}

// fsService is envd's filesystem.Filesystem over carrel's FileService.
type fsService struct{ s *server }

var _ filesystempbconnect.FilesystemHandler = fsService{}

func (f fsService) Stat(ctx context.Context, req *connect.Request[filesystempb.StatRequest]) (*connect.Response[filesystempb.StatResponse], error) {
	e, err := f.s.stat(ctx, resolve(req.Msg.Path))
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&filesystempb.StatResponse{Entry: e}), nil
}

func (s *server) stat(ctx context.Context, p string) (*filesystempb.EntryInfo, error) {
	if p == "" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("a path is required"))
	}
	resp, err := s.c.Files.Stat(ctx, forVM(ctx, &agentv1.StatRequest{Path: p}))
	if err != nil {
		return nil, err
	}
	return entry(resp.Msg.Info), nil
}

// MakeDir makes a directory and its parents: AlreadyExists when it was
// there (the SDK's makeDir then returns false).
func (f fsService) MakeDir(ctx context.Context, req *connect.Request[filesystempb.MakeDirRequest]) (*connect.Response[filesystempb.MakeDirResponse], error) {
	p := resolve(req.Msg.Path)
	if e, err := f.s.stat(ctx, p); err == nil {
		if e.Type == filesystempb.FileType_FILE_TYPE_DIRECTORY {
			return nil, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("directory %s already exists", p))
		}
		return nil, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("%s exists and is not a directory", p))
	} else if connect.CodeOf(err) != connect.CodeNotFound {
		return nil, err
	}
	if _, err := f.s.c.Files.MakeDir(ctx, forVM(ctx, &agentv1.MakeDirRequest{Path: p, Parents: true})); err != nil {
		return nil, err
	}
	e, err := f.s.stat(ctx, p)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&filesystempb.MakeDirResponse{Entry: e}), nil
}

func (f fsService) Move(ctx context.Context, req *connect.Request[filesystempb.MoveRequest]) (*connect.Response[filesystempb.MoveResponse], error) {
	from, to := resolve(req.Msg.Source), resolve(req.Msg.Destination)
	if _, err := f.s.c.Files.Rename(ctx, forVM(ctx, &agentv1.RenameRequest{From: from, To: to})); err != nil {
		return nil, err
	}
	e, err := f.s.stat(ctx, to)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&filesystempb.MoveResponse{Entry: e}), nil
}

func (f fsService) Remove(ctx context.Context, req *connect.Request[filesystempb.RemoveRequest]) (*connect.Response[filesystempb.RemoveResponse], error) {
	if _, err := f.s.c.Files.Remove(ctx, forVM(ctx, &agentv1.RemoveRequest{Path: resolve(req.Msg.Path), Recursive: true})); err != nil {
		return nil, err
	}
	return connect.NewResponse(&filesystempb.RemoveResponse{}), nil
}

// Bounds on ListDir: its depth, and the size of its answer, which is
// built whole.
const (
	maxListDepth = 64
	maxListBytes = 16 << 20
)

func (f fsService) ListDir(ctx context.Context, req *connect.Request[filesystempb.ListDirRequest]) (*connect.Response[filesystempb.ListDirResponse], error) {
	p := resolve(req.Msg.Path)
	depth := max(req.Msg.Depth, 1)
	if depth > maxListDepth {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("depth %d: at most %d", depth, maxListDepth))
	}
	if e, err := f.s.stat(ctx, p); err != nil {
		return nil, err
	} else if e.Type != filesystempb.FileType_FILE_TYPE_DIRECTORY {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%s is not a directory", p))
	}
	stream, err := f.s.c.Files.List(ctx, forVM(ctx, &agentv1.ListRequest{Path: p, Recursive: depth > 1, MaxDepth: depth}))
	if err != nil {
		return nil, err
	}
	defer stream.Close()
	resp := &filesystempb.ListDirResponse{}
	var size int
	for stream.Receive() {
		for _, fi := range stream.Msg().Entries {
			if fi.Path == p {
				continue // the directory itself
			}
			if size += len(fi.Path) + len(fi.LinkTarget) + 64; size > maxListBytes {
				return nil, connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("the listing of %s is over %d bytes: list less deep", p, maxListBytes))
			}
			resp.Entries = append(resp.Entries, entry(fi))
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return connect.NewResponse(resp), nil
}

// entry is envd's EntryInfo for a carrel FileInfo.
func entry(fi *agentv1.FileInfo) *filesystempb.EntryInfo {
	mode := fs.FileMode(fi.Mode & 0o777)
	if fi.Mode&0o4000 != 0 {
		mode |= fs.ModeSetuid
	}
	if fi.Mode&0o2000 != 0 {
		mode |= fs.ModeSetgid
	}
	if fi.Mode&0o1000 != 0 {
		mode |= fs.ModeSticky
	}
	e := &filesystempb.EntryInfo{
		Name: path.Base(fi.Path), Path: fi.Path, Size: fi.Size,
		Owner: account(fi.Uid), Group: account(fi.Gid),
		ModifiedTime: timestamppb.New(time.Unix(0, fi.MtimeUnixNano)),
	}
	switch fi.Type {
	case agentv1.FileType_FILE_TYPE_DIRECTORY:
		e.Type, mode = filesystempb.FileType_FILE_TYPE_DIRECTORY, mode|fs.ModeDir
	case agentv1.FileType_FILE_TYPE_SYMLINK:
		e.Type, mode = filesystempb.FileType_FILE_TYPE_SYMLINK, mode|fs.ModeSymlink
		target := fi.LinkTarget
		e.SymlinkTarget = &target
	default:
		e.Type = filesystempb.FileType_FILE_TYPE_FILE
	}
	e.Mode, e.Permissions = uint32(mode), mode.String()
	return e
}

// account names the guest's users as carrel's images have them.
func account(id uint32) string {
	switch id {
	case 0:
		return "root"
	case 1000:
		return "agent"
	}
	return strconv.FormatUint(uint64(id), 10)
}

// WatchDir streams a start event once the watch is in place, then each
// change under the directory, named relative to it.
func (f fsService) WatchDir(ctx context.Context, req *connect.Request[filesystempb.WatchDirRequest], out *connect.ServerStream[filesystempb.WatchDirResponse]) error {
	if req.Msg.IncludeEntry {
		return connect.NewError(connect.CodeUnimplemented, errors.New("watch: entries in events are not served (envd 0.6.3)"))
	}
	dir := resolve(req.Msg.Path)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var mu sync.Mutex // the keepalive ticker and the watch both send
	send := func(m *filesystempb.WatchDirResponse) error {
		mu.Lock()
		defer mu.Unlock()
		return out.Send(m)
	}
	if every := keepaliveEvery(req.Header()); every > 0 {
		go func() {
			t := time.NewTicker(every)
			defer t.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
					if send(&filesystempb.WatchDirResponse{Event: &filesystempb.WatchDirResponse_Keepalive{Keepalive: &filesystempb.WatchDirResponse_KeepAlive{}}}) != nil {
						cancel()
						return
					}
				}
			}
		}()
	}
	started := false
	err := f.s.c.Watch(ctx, callOf(ctx).vm, dir, client.WatchOptions{Recursive: req.Msg.Recursive}, func(m *agentv1.WatchResponse) error {
		if !started {
			started = true
			if err := send(&filesystempb.WatchDirResponse{Event: &filesystempb.WatchDirResponse_Start{Start: &filesystempb.WatchDirResponse_StartEvent{}}}); err != nil {
				return err
			}
		}
		for _, ev := range events(dir, m) {
			if err := send(&filesystempb.WatchDirResponse{Event: &filesystempb.WatchDirResponse_Filesystem{Filesystem: ev}}); err != nil {
				return err
			}
		}
		return nil
	})
	if ctx.Err() != nil {
		return nil // the client went
	}
	return err
}

// writeTempPrefix begins the names of the files the guest agent writes a
// file's new content to before it renames them over the file
// (guest-agent/files): a write through carrel is, to a watch, a create,
// a write and a rename of one of those.
const writeTempPrefix = ".carrel-write-"

// events turns a batch of carrel's watch events into envd's. The agent's
// atomic writes read as envd's plain ones: the temporary file is not
// shown, and its rename over the target is the target's create and write.
func events(dir string, m *agentv1.WatchResponse) []*filesystempb.FilesystemEvent {
	var out []*filesystempb.FilesystemEvent
	for _, ev := range m.Events {
		if strings.HasPrefix(path.Base(ev.Path), writeTempPrefix) {
			continue
		}
		if ev.Op == agentv1.WatchOp_WATCH_OP_RENAME && strings.HasPrefix(path.Base(ev.OldPath), writeTempPrefix) {
			name := rel(dir, ev.Path)
			out = append(out,
				&filesystempb.FilesystemEvent{Name: name, Type: filesystempb.EventType_EVENT_TYPE_CREATE},
				&filesystempb.FilesystemEvent{Name: name, Type: filesystempb.EventType_EVENT_TYPE_WRITE})
			continue
		}
		var t filesystempb.EventType
		switch ev.Op {
		case agentv1.WatchOp_WATCH_OP_CREATE:
			t = filesystempb.EventType_EVENT_TYPE_CREATE
		case agentv1.WatchOp_WATCH_OP_MODIFY:
			t = filesystempb.EventType_EVENT_TYPE_WRITE
		case agentv1.WatchOp_WATCH_OP_DELETE:
			t = filesystempb.EventType_EVENT_TYPE_REMOVE
		case agentv1.WatchOp_WATCH_OP_RENAME:
			// envd reports a rename as the old name going and the new one
			// coming.
			out = append(out, &filesystempb.FilesystemEvent{Name: rel(dir, ev.OldPath), Type: filesystempb.EventType_EVENT_TYPE_RENAME})
			t = filesystempb.EventType_EVENT_TYPE_CREATE
		default:
			continue
		}
		out = append(out, &filesystempb.FilesystemEvent{Name: rel(dir, ev.Path), Type: t})
	}
	return out
}

func rel(dir, p string) string {
	if r, ok := strings.CutPrefix(p, strings.TrimSuffix(dir, "/")+"/"); ok {
		return r
	}
	return path.Base(p)
}

// The polling watcher (the Python SDK's): a watch carreld keeps for the
// client, its events held until fetched.
const (
	maxWatchers      = 256 // per façade
	maxWatchersPerVM = 16
	watcherStart     = 30 * time.Second
	maxWatcherEvents = 10_000 // held per watcher; older ones are dropped
	watcherIdle      = 10 * time.Minute
)

type watchers struct {
	mu   sync.Mutex
	byID map[string]*watcher
}

type watcher struct {
	vm     string
	cancel context.CancelFunc
	mu     sync.Mutex
	events []*filesystempb.FilesystemEvent
	err    error
	used   time.Time
}

func newWatchers() *watchers { return &watchers{byID: map[string]*watcher{}} }

func (f fsService) CreateWatcher(ctx context.Context, req *connect.Request[filesystempb.CreateWatcherRequest]) (*connect.Response[filesystempb.CreateWatcherResponse], error) {
	if req.Msg.IncludeEntry {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("watch: entries in events are not served (envd 0.6.3)"))
	}
	ws := f.s.watch
	c := callOf(ctx)
	var b [8]byte
	_, _ = rand.Read(b[:])
	id := hex.EncodeToString(b[:])
	// The slot is taken before the watch starts: no two creates overrun
	// the caps, and a watch that never starts still counts.
	ws.mu.Lock()
	ws.reapLocked(time.Now())
	n := 0
	for _, w := range ws.byID {
		if w.vm == c.vm {
			n++
		}
	}
	if n >= maxWatchersPerVM || len(ws.byID) >= maxWatchers {
		ws.mu.Unlock()
		return nil, connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("%d watchers are open for this sandbox (%d in all): remove some", n, len(ws.byID)))
	}
	pending := &watcher{vm: c.vm, cancel: func() {}, used: time.Now()}
	ws.byID[id] = pending
	ws.mu.Unlock()
	release := func() {
		ws.mu.Lock()
		if ws.byID[id] == pending {
			delete(ws.byID, id)
		}
		ws.mu.Unlock()
	}
	dir := resolve(req.Msg.Path)
	// The watch outlives this call: it runs on its own context, with the
	// caller's credential, until removed or left unread.
	wctx, cancel := context.WithCancel(withCall(context.WithoutCancel(ctx), c))
	w := &watcher{vm: c.vm, cancel: cancel, used: time.Now()}
	ready := make(chan error, 2)
	go func() {
		started := false
		err := f.s.c.Watch(wctx, c.vm, dir, client.WatchOptions{Recursive: req.Msg.Recursive}, func(m *agentv1.WatchResponse) error {
			if !started {
				started = true
				ready <- nil
			}
			w.add(events(dir, m))
			return nil
		})
		if !started {
			ready <- err
		}
		w.mu.Lock()
		w.err = err
		w.mu.Unlock()
	}()
	// The guest sends its first batch once the watch is in place; one
	// that does not, within watcherStart, fails the create.
	var err error
	select {
	case err = <-ready:
	case <-ctx.Done():
		err = ctx.Err()
	case <-time.After(watcherStart):
		err = connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("the watch did not start within %s", watcherStart))
	}
	if err != nil {
		cancel()
		release()
		return nil, err
	}
	ws.mu.Lock()
	ws.byID[id] = w
	ws.mu.Unlock()
	return connect.NewResponse(&filesystempb.CreateWatcherResponse{WatcherId: id}), nil
}

func (w *watcher) add(evs []*filesystempb.FilesystemEvent) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.events = append(w.events, evs...)
	if over := len(w.events) - maxWatcherEvents; over > 0 {
		w.events = append(w.events[:0], w.events[over:]...)
	}
}

// get returns a watcher of the call's sandbox.
func (ws *watchers) get(ctx context.Context, id string) (*watcher, error) {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	w, ok := ws.byID[id]
	if !ok || w.vm != callOf(ctx).vm {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("watcher %q not found", clip(id)))
	}
	return w, nil
}

// reapLocked stops watchers nobody has read for watcherIdle.
func (ws *watchers) reapLocked(now time.Time) {
	for id, w := range ws.byID {
		w.mu.Lock()
		idle := now.Sub(w.used) > watcherIdle
		w.mu.Unlock()
		if idle {
			w.cancel()
			delete(ws.byID, id)
		}
	}
}

func (f fsService) GetWatcherEvents(ctx context.Context, req *connect.Request[filesystempb.GetWatcherEventsRequest]) (*connect.Response[filesystempb.GetWatcherEventsResponse], error) {
	w, err := f.s.watch.get(ctx, req.Msg.WatcherId)
	if err != nil {
		return nil, err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.used = time.Now()
	evs := w.events
	w.events = nil
	if len(evs) == 0 && w.err != nil {
		return nil, w.err // the watch ended; its events are all given
	}
	return connect.NewResponse(&filesystempb.GetWatcherEventsResponse{Events: evs}), nil
}

func (f fsService) RemoveWatcher(ctx context.Context, req *connect.Request[filesystempb.RemoveWatcherRequest]) (*connect.Response[filesystempb.RemoveWatcherResponse], error) {
	ws := f.s.watch
	if _, err := ws.get(ctx, req.Msg.WatcherId); err != nil {
		return nil, err
	}
	ws.mu.Lock()
	if w, ok := ws.byID[req.Msg.WatcherId]; ok {
		w.cancel()
		delete(ws.byID, req.Msg.WatcherId)
	}
	ws.mu.Unlock()
	return connect.NewResponse(&filesystempb.RemoveWatcherResponse{}), nil
}
