package e2b

import (
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"path"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1"
	apiv1 "github.com/carrel-os/carrel/supervisor/gen/apiv1"
	filesystempb "github.com/carrel-os/carrel/supervisor/gen/envdpb/filesystem"
)

// writeChunk is the size of each message of a file upload to carreld.
const writeChunk = 256 << 10

// download serves GET /files?path=: the file's bytes. Errors are JSON
// {code, message}, the status from carreld's answer (403 for a path the
// policy denies, 404 for none there).
func (s *server) download(w http.ResponseWriter, r *http.Request) {
	p := resolve(r.URL.Query().Get("path"))
	if p == "" {
		writeError(w, http.StatusBadRequest, "path is required")
		return
	}
	ctx := r.Context()
	info, err := s.stat(ctx, p)
	if err != nil {
		writeCarrelError(w, err)
		return
	}
	if info.Type == filesystempb.FileType_FILE_TYPE_DIRECTORY {
		writeError(w, http.StatusBadRequest, p+" is a directory")
		return
	}
	stream, err := s.c.Files.Read(ctx, forVM(ctx, &agentv1.ReadRequest{Path: p}))
	if err != nil {
		writeCarrelError(w, err)
		return
	}
	defer stream.Close()
	// The first message tells a failure from a file: until then nothing
	// is written.
	first := stream.Receive()
	if !first && stream.Err() != nil {
		writeCarrelError(w, stream.Err())
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Disposition", mime.FormatMediaType("attachment", map[string]string{"filename": path.Base(p)}))
	if info.Size == 0 && !first {
		w.Header().Set("Content-Length", "0")
	}
	w.WriteHeader(http.StatusOK)
	for ok := first; ok; ok = stream.Receive() {
		if _, err := w.Write(stream.Msg().Data); err != nil {
			return
		}
	}
	if err := stream.Err(); err != nil {
		// Too late for a status: cut the response so the client sees it.
		panic(http.ErrAbortHandler)
	}
}

// writtenEntry is what an upload reports of each file.
type writtenEntry struct {
	Name string `json:"name"`
	Type string `json:"type"`
	Path string `json:"path"`
}

// upload serves POST /files: a raw body (application/octet-stream) for
// ?path=, or multipart/form-data "file" parts, each at ?path= or at its
// file name. Parent directories are made; files are replaced whole, or
// left as they were when the upload fails.
func (s *server) upload(w http.ResponseWriter, r *http.Request) {
	r.Body = http.MaxBytesReader(w, r.Body, s.cfg.MaxUpload)
	ctx := r.Context()
	target := r.URL.Query().Get("path")
	var out []writtenEntry
	write := func(p string, body io.Reader) bool {
		p = resolve(p)
		if p == "" {
			writeError(w, http.StatusBadRequest, "path is required (the path query parameter or the part's file name)")
			return false
		}
		if err := s.writeFile(ctx, p, body); err != nil {
			var tooBig *http.MaxBytesError
			if errors.As(err, &tooBig) {
				writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("the upload is over %d bytes", s.cfg.MaxUpload))
				return false
			}
			writeCarrelError(w, err)
			return false
		}
		out = append(out, writtenEntry{Name: path.Base(p), Type: "file", Path: p})
		return true
	}
	mt, params, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	switch mt {
	case "multipart/form-data":
		mr := multipart.NewReader(r.Body, params["boundary"])
		for {
			part, err := mr.NextPart()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				var tooBig *http.MaxBytesError
				if errors.As(err, &tooBig) {
					writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("the upload is over %d bytes", s.cfg.MaxUpload))
					return
				}
				writeError(w, http.StatusBadRequest, "malformed multipart body: "+err.Error())
				return
			}
			if part.FormName() != "file" {
				continue
			}
			p := target
			if p == "" {
				// The SDKs put a file's whole path in its file name; Go's
				// Part.FileName keeps only the last element.
				_, cd, _ := mime.ParseMediaType(part.Header.Get("Content-Disposition"))
				p = cd["filename"]
			}
			if !write(p, part) {
				return
			}
		}
		if len(out) == 0 {
			writeError(w, http.StatusBadRequest, "no file part in the multipart body")
			return
		}
	case "application/octet-stream", "":
		var body io.Reader = r.Body
		if r.Header.Get("Content-Encoding") == "gzip" {
			zr, err := gzip.NewReader(r.Body)
			if err != nil {
				writeError(w, http.StatusBadRequest, "malformed gzip body: "+err.Error())
				return
			}
			body = io.LimitReader(zr, s.cfg.MaxUpload+1)
		}
		if !write(target, body) {
			return
		}
	default:
		writeError(w, http.StatusUnsupportedMediaType, "the body must be application/octet-stream or multipart/form-data")
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// writeFile streams body to p in the call's VM. The write commits only
// once all of it is sent, so a failed upload changes nothing.
func (s *server) writeFile(ctx context.Context, p string, body io.Reader) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream := s.c.Files.Write(ctx)
	stream.RequestHeader().Set("Carrel-Vm", callOf(ctx).vm)
	if err := stream.Send(&agentv1.WriteRequest{Msg: &agentv1.WriteRequest_Header{Header: &agentv1.WriteHeader{Path: p, MakeParents: true}}}); err != nil {
		_, err = stream.CloseAndReceive()
		return err
	}
	buf := make([]byte, writeChunk)
	var total int64
	for {
		n, err := body.Read(buf)
		if n > 0 {
			total += int64(n)
			if total > s.cfg.MaxUpload {
				return &http.MaxBytesError{Limit: s.cfg.MaxUpload}
			}
			if serr := stream.Send(&agentv1.WriteRequest{Msg: &agentv1.WriteRequest_Data{Data: buf[:n]}}); serr != nil {
				_, serr = stream.CloseAndReceive()
				return serr
			}
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err // cancel drops the write uncommitted
		}
	}
	if err := stream.Send(&agentv1.WriteRequest{Msg: &agentv1.WriteRequest_Commit{Commit: &agentv1.WriteCommit{}}}); err != nil {
		_, err = stream.CloseAndReceive()
		return err
	}
	_, err := stream.CloseAndReceive()
	return err
}

// health is 204 while the sandbox's agent answers, 502 otherwise (the
// SDKs read 502 as "not running").
func (s *server) health(w http.ResponseWriter, r *http.Request) {
	vm, err := s.getVM(r.Context(), callOf(r.Context()).vm)
	if err != nil {
		writeCarrelError(w, err)
		return
	}
	if vm.State != apiv1.VMState_VM_STATE_RUNNING || vm.AgentState != apiv1.AgentState_AGENT_STATE_READY {
		writeError(w, http.StatusBadGateway, "sandbox "+vm.Name+" is not running")
		return
	}
	w.WriteHeader(http.StatusNoContent)
}
