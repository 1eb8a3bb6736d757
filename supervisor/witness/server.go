package witness

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"

	"github.com/carrel-os/carrel/supervisor/atomicfile"
)

// Caps on a request.
const (
	maxRequestBytes = 64 << 10
	// maxProofHashes bounds a consistency proof: 2*log2 of a tree of
	// 2^63 leaves is under this.
	maxProofHashes = 128
)

// Config is a witness.
type Config struct {
	Signer *Signer
	// Logs are the logs the witness cosigns, by origin (a checkpoint's
	// first line): each one's key.
	Logs map[string]note.Verifier
	// StateDir keeps, per log, the latest checkpoint cosigned.
	StateDir string
	Logger   *slog.Logger
}

type server struct {
	cfg Config
	mu  sync.Mutex // one add at a time: each reads and moves a log's state
}

// Handler serves the witness: POST /add-checkpoint (C2SP tlog-witness).
func Handler(cfg Config) http.Handler {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	s := &server{cfg: cfg}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /add-checkpoint", s.add)
	return mux
}

// request is an add-checkpoint body: "old N", the consistency proof from
// tree N to the checkpoint's tree (a base64 hash a line), a blank line,
// then the signed checkpoint.
type request struct {
	old        uint64
	proof      tlog.TreeProof
	checkpoint []byte
}

func parseRequest(b []byte) (request, error) {
	var r request
	br := bufio.NewReader(bytes.NewReader(b))
	line, err := br.ReadString('\n')
	if err != nil {
		return r, errors.New("no old size line")
	}
	n, ok := strings.CutPrefix(strings.TrimSuffix(line, "\n"), "old ")
	if !ok {
		return r, fmt.Errorf("the first line %.40q is not \"old N\"", line)
	}
	if r.old, err = strconv.ParseUint(n, 10, 64); err != nil || strconv.FormatUint(r.old, 10) != n {
		return r, fmt.Errorf("old size %.40q", n)
	}
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			return r, errors.New("no blank line before the checkpoint")
		}
		line = strings.TrimSuffix(line, "\n")
		if line == "" {
			break
		}
		if len(r.proof) == maxProofHashes {
			return r, fmt.Errorf("a proof of more than %d hashes", maxProofHashes)
		}
		h, err := base64.StdEncoding.DecodeString(line)
		if err != nil || len(h) != tlog.HashSize {
			return r, fmt.Errorf("proof line %.60q is not a base64 hash", line)
		}
		r.proof = append(r.proof, tlog.Hash(h))
	}
	r.checkpoint, _ = io.ReadAll(br)
	return r, nil
}

// parseCheckpoint reads a C2SP checkpoint's text: origin, size, root.
func parseCheckpoint(text string) (origin string, size uint64, root tlog.Hash, err error) {
	lines := strings.SplitN(text, "\n", 4)
	if len(lines) < 4 {
		return "", 0, tlog.Hash{}, errors.New("a checkpoint has an origin, a size and a root hash, a line each")
	}
	if size, err = strconv.ParseUint(lines[1], 10, 64); err != nil || strconv.FormatUint(size, 10) != lines[1] {
		return "", 0, tlog.Hash{}, fmt.Errorf("tree size %.40q", lines[1])
	}
	h, err := base64.StdEncoding.DecodeString(lines[2])
	if err != nil || len(h) != tlog.HashSize {
		return "", 0, tlog.Hash{}, fmt.Errorf("root hash %.60q", lines[2])
	}
	return lines[0], size, tlog.Hash(h), nil
}

func (s *server) add(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxRequestBytes+1))
	if err != nil {
		http.Error(w, "read the request: "+err.Error(), http.StatusBadRequest)
		return
	}
	if len(body) > maxRequestBytes {
		http.Error(w, fmt.Sprintf("a request over %d bytes", maxRequestBytes), http.StatusRequestEntityTooLarge)
		return
	}
	req, err := parseRequest(body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	origin, _, _ := strings.Cut(string(req.checkpoint), "\n")
	logKey, ok := s.cfg.Logs[origin]
	if !ok {
		http.Error(w, fmt.Sprintf("unknown log %.100q", origin), http.StatusNotFound)
		return
	}
	n, err := note.Open(req.checkpoint, note.VerifierList(logKey))
	if err != nil {
		http.Error(w, "the checkpoint's signature: "+err.Error(), http.StatusForbidden)
		return
	}
	_, size, root, err := parseCheckpoint(n.Text)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	st, err := s.load(origin)
	if err != nil {
		s.cfg.Logger.Error("witness state", "log", origin, "err", err)
		http.Error(w, "the witness's state is unreadable", http.StatusInternalServerError)
		return
	}
	if req.old != st.size {
		// The client's idea of what was cosigned last is not ours: it
		// tries again from our size.
		w.Header().Set("Content-Type", "text/x.tlog.size")
		w.WriteHeader(http.StatusConflict)
		fmt.Fprintf(w, "%d\n", st.size)
		return
	}
	if why := consistent(req, st, size, root); why != "" {
		s.cfg.Logger.Warn("witness refused a checkpoint", "log", origin, "size", size, "why", why)
		http.Error(w, why, http.StatusUnprocessableEntity)
		return
	}
	if size > st.size {
		if err := s.save(origin, state{size: size, root: root}); err != nil {
			s.cfg.Logger.Error("witness state", "log", origin, "err", err)
			http.Error(w, "the witness could not keep the checkpoint", http.StatusInternalServerError)
			return
		}
	}
	signed, err := note.Sign(&note.Note{Text: n.Text}, s.cfg.Signer)
	if err != nil {
		http.Error(w, "cosign: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/x.tlog.signature")
	w.Write(signed[len(n.Text)+1:]) // the signature line alone
}

// consistent says why a checkpoint of size and root does not extend the
// one cosigned last (st), or "".
func consistent(req request, st state, size uint64, root tlog.Hash) string {
	switch {
	case size < st.size:
		return fmt.Sprintf("the checkpoint's tree (%d) is smaller than the last one cosigned (%d)", size, st.size)
	case size == st.size && root != st.root:
		return fmt.Sprintf("a second, different tree of size %d: the log forked", size)
	case st.size == 0 || size == st.size:
		if len(req.proof) != 0 {
			return "a consistency proof where none is needed"
		}
		return ""
	}
	if err := tlog.CheckTree(req.proof, int64(size), root, int64(st.size), st.root); err != nil {
		return fmt.Sprintf("the tree of size %d does not extend the one cosigned at size %d: %v", size, st.size, err)
	}
	return ""
}

// state is a log's latest cosigned checkpoint.
type state struct {
	size uint64
	root tlog.Hash
}

func (s *server) path(origin string) string {
	sum := sha256.Sum256([]byte(origin))
	return filepath.Join(s.cfg.StateDir, hex.EncodeToString(sum[:16]))
}

func (s *server) load(origin string) (state, error) {
	b, err := os.ReadFile(s.path(origin))
	if errors.Is(err, os.ErrNotExist) {
		return state{}, nil
	}
	if err != nil {
		return state{}, err
	}
	_, size, root, err := parseCheckpoint(string(b))
	if err != nil {
		return state{}, fmt.Errorf("%s: %w", s.path(origin), err)
	}
	return state{size: size, root: root}, nil
}

func (s *server) save(origin string, st state) error {
	if err := os.MkdirAll(s.cfg.StateDir, 0o700); err != nil {
		return err
	}
	return atomicfile.WriteFile(s.path(origin), fmt.Appendf(nil, "%s\n%d\n%s\n", origin, st.size, st.root), 0o600)
}
