//go:build linux

package files

import (
	"context"
	"io/fs"
	"syscall"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

// Stat describes path without following a final symlink. CodeNotFound if
// it does not exist.
func (s *Service) Stat(_ context.Context, req *connect.Request[agentv1.StatRequest]) (*connect.Response[agentv1.StatResponse], error) {
	pl, err := s.resolve("stat", req.Msg.GetPath(), readAccess)
	if err != nil {
		return nil, err
	}
	defer pl.close()
	p := pl.path
	if _, err := pl.resolved("stat", false); err != nil {
		return nil, err
	}
	fi, err := pl.t.Lstat(pl.name)
	if err != nil {
		return nil, fsError("stat", p, err)
	}
	info, err := fileInfo(p, fi, func() (string, error) { return pl.t.Readlink(pl.name) })
	if err != nil {
		return nil, fsError("stat", p, err)
	}
	return connect.NewResponse(&agentv1.StatResponse{Info: info}), nil
}

// fileInfo describes p from its Lstat result; readlink reads it if it is
// a symlink.
func fileInfo(p string, fi fs.FileInfo, readlink func() (string, error)) (*agentv1.FileInfo, error) {
	info := &agentv1.FileInfo{
		Path:          p,
		Size:          fi.Size(),
		MtimeUnixNano: fi.ModTime().UnixNano(),
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		info.Mode = st.Mode & modeBits
		info.Uid, info.Gid = st.Uid, st.Gid
	}
	switch m := fi.Mode(); {
	case m.IsRegular():
		info.Type = agentv1.FileType_FILE_TYPE_REGULAR
	case m.IsDir():
		info.Type = agentv1.FileType_FILE_TYPE_DIRECTORY
	case m&fs.ModeSymlink != 0:
		info.Type = agentv1.FileType_FILE_TYPE_SYMLINK
		target, err := readlink()
		if err != nil {
			return nil, err
		}
		info.LinkTarget = target
	default:
		info.Type = agentv1.FileType_FILE_TYPE_OTHER
	}
	return info, nil
}
