package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/guest-agent/tarfs"
)

// chunkBytes is how much one write message carries: as much as a message
// to carreld and on to the guest may hold (protocol.MaxMessageBytes), less
// room for the framing, since each message costs the guest the same
// whatever its size.
const chunkBytes = protocol.MaxMessageBytes - 1<<10

// ForVM is a request for the guest's services (Files, Agent, Ports), which
// carreld relays to vm.
func ForVM[T any](vm string, msg *T) *connect.Request[T] {
	req := connect.NewRequest(msg)
	req.Header().Set(protocol.VMHeader, vm)
	return req
}

// Stat describes path in vm. It does not follow a final symlink.
func (c *Client) Stat(ctx context.Context, vm, path string) (*agentv1.FileInfo, error) {
	resp, err := c.Files.Stat(ctx, ForVM(vm, &agentv1.StatRequest{Path: path}))
	if err != nil {
		return nil, err
	}
	return resp.Msg.Info, nil
}

// Download streams the file at path in vm to w and returns the bytes
// copied.
func (c *Client) Download(ctx context.Context, vm, path string, w io.Writer) (int64, error) {
	s, err := c.Files.Read(ctx, ForVM(vm, &agentv1.ReadRequest{Path: path}))
	if err != nil {
		return 0, err
	}
	defer s.Close()
	var n int64
	for s.Receive() {
		k, err := w.Write(s.Msg().Data)
		n += int64(k)
		if err != nil {
			return n, err
		}
	}
	return n, s.Err()
}

// Upload writes everything r yields to path in vm, atomically: the file
// appears whole or not at all. It commits the write only once r is
// exhausted; a read error or a cancelled ctx leaves the guest untouched.
// mode 0 means 0644 for a new file (an existing file keeps its mode).
func (c *Client) Upload(ctx context.Context, vm, path string, r io.Reader, mode uint32) (*agentv1.WriteResponse, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // a failed upload is abandoned, never committed
	s := c.Files.Write(ctx)
	s.RequestHeader().Set(protocol.VMHeader, vm)
	sendErr := s.Send(&agentv1.WriteRequest{Msg: &agentv1.WriteRequest_Header{Header: &agentv1.WriteHeader{Path: path, Mode: mode}}})
	buf := make([]byte, chunkBytes)
	for sendErr == nil {
		n, err := r.Read(buf)
		if n > 0 {
			sendErr = s.Send(&agentv1.WriteRequest{Msg: &agentv1.WriteRequest_Data{Data: buf[:n]}})
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("upload %s: %w", path, err)
		}
	}
	if sendErr == nil {
		// Everything was sent: only now may the guest put the file in place.
		sendErr = s.Send(&agentv1.WriteRequest{Msg: &agentv1.WriteRequest_Commit{Commit: &agentv1.WriteCommit{}}})
	}
	// A send error means the server ended the call: its reason is in the
	// response.
	resp, err := s.CloseAndReceive()
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

// DownloadTree copies the file or tree at path in vm into the host
// directory dir, keeping its name: /w/proj lands as dir/proj. The archive
// comes from the guest, so it is extracted through an os.Root beneath dir
// and nowhere else (see tarfs). skipped, if not nil, hears of entries left
// out (devices, fifos).
func (c *Client) DownloadTree(ctx context.Context, vm, path, dir string, skipped func(name, why string)) (tarfs.Stats, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return tarfs.Stats{}, err
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return tarfs.Stats{}, err
	}
	defer root.Close()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s, err := c.Files.ReadTar(ctx, ForVM(vm, &agentv1.ReadTarRequest{Path: path}))
	if err != nil {
		return tarfs.Stats{}, err
	}
	defer s.Close()
	pr, pw := io.Pipe()
	go func() {
		for s.Receive() {
			if _, err := pw.Write(s.Msg().Data); err != nil {
				return
			}
		}
		pw.CloseWithError(s.Err())
	}()
	st, err := tarfs.Extract(pr, root, tarfs.Options{Skipped: skipped})
	pr.CloseWithError(io.ErrClosedPipe)
	return st, err
}

// UploadTree copies the host file or tree at path into the directory dir
// in vm (created if missing), keeping its name. Extraction in the guest is
// not atomic: on an error, what was extracted stays.
func (c *Client) UploadTree(ctx context.Context, vm, path, dir string, skipped func(name, why string)) (*agentv1.WriteResponse, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s := c.Files.WriteTar(ctx)
	s.RequestHeader().Set(protocol.VMHeader, vm)
	if err := s.Send(&agentv1.WriteRequest{Msg: &agentv1.WriteRequest_Header{Header: &agentv1.WriteHeader{Path: dir, MakeParents: true}}}); err != nil {
		_, err := s.CloseAndReceive()
		return nil, err
	}
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(tarfs.Pack(pw, path, skipped)) }()
	buf := make([]byte, chunkBytes)
	for {
		n, err := io.ReadFull(pr, buf)
		if n > 0 {
			if s.Send(&agentv1.WriteRequest{Msg: &agentv1.WriteRequest_Data{Data: buf[:n]}}) != nil {
				pr.CloseWithError(io.ErrClosedPipe)
				_, err := s.CloseAndReceive()
				return nil, err
			}
		}
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("upload %s: %w", path, err)
		}
	}
	if err := s.Send(&agentv1.WriteRequest{Msg: &agentv1.WriteRequest_Commit{Commit: &agentv1.WriteCommit{}}}); err != nil {
		_, err := s.CloseAndReceive()
		return nil, err
	}
	resp, err := s.CloseAndReceive()
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}
