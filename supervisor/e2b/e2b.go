// Package e2b serves the e2b API, so that an unmodified e2b SDK drives
// carrel VMs: the control plane (create, list, get, kill, time-outs,
// pause and connect, under /sandboxes and /v2/sandboxes) and the envd
// services a sandbox's SDK calls (process.Process and
// filesystem.Filesystem over Connect with JSON, and the plain /files and
// /health routes), on one listener. Point E2B_API_URL and E2B_SANDBOX_URL
// at it; envd calls name their sandbox in the E2b-Sandbox-Id header.
//
// The façade holds no authority of its own. It translates each request
// into calls on carreld's API, made over an in-process connection that
// carries no peer credentials (api.Pipe), with the caller's own
// credential: the API key (X-API-KEY) on the control plane, the sandbox
// token (X-Access-Token, the envdAccessToken of the create reply) on
// envd. carreld authenticates it, its policy decides (carrel.api.key
// rules), the guest enforces and the audit log records the key's
// identity, exactly as for any other client. A sandbox is a VM named
// "e2b-KEYNAME-<hex>"; its template is a carrel image tag.
package e2b

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"strings"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/supervisor/gen/envdpb/filesystem/filesystempbconnect"
	"github.com/carrel-os/carrel/supervisor/gen/envdpb/process/processpbconnect"
	"github.com/carrel-os/carrel/supervisor/identity"
)

// EnvdVersion is the envd version sandboxes report. The SDKs gate
// features on it: 0.5.7 turns on what carrel serves (stdin control,
// closing stdin, the default user, raw uploads, recursive watches) and
// leaves off file metadata (0.6.2) and entries in watch events (0.6.3),
// which the SDK then refuses with a clear message.
const EnvdVersion = "0.5.7"

// Caps on what a client sends.
const (
	// DefaultMaxUpload caps one POST /files body.
	DefaultMaxUpload = 1 << 30
	maxJSONBody      = 1 << 20
	maxConnectMsg    = 4 << 20
)

// Headers of the e2b protocol.
const (
	headerAPIKey    = "X-Api-Key"
	headerToken     = "X-Access-Token"
	headerSandboxID = "E2b-Sandbox-Id"
	headerKeepalive = "Keepalive-Ping-Interval"
)

// Config wires the façade to carreld.
type Config struct {
	// Dial connects to carreld's API (api.Pipe.Dial).
	Dial func(context.Context) (net.Conn, error)
	// Tokens verifies API keys and makes sandbox tokens.
	Tokens *identity.Tokens
	// MaxUpload caps one POST /files body; 0 means DefaultMaxUpload.
	MaxUpload int64
	Logger    *slog.Logger
}

type server struct {
	cfg   Config
	c     *client.Client
	procs *procTable
	watch *watchers
	log   *slog.Logger
}

// Handler serves the e2b API.
func Handler(cfg Config) http.Handler {
	if cfg.MaxUpload <= 0 {
		cfg.MaxUpload = DefaultMaxUpload
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	s := &server{cfg: cfg, procs: newProcTable(), watch: newWatchers(), log: cfg.Logger}
	s.c = client.New("", client.WithDialer(cfg.Dial), client.WithCredentials(credOf))
	mux := http.NewServeMux()
	// The control plane. The JS SDK (2.x) creates, connects and lists at
	// /v2, the Python SDK and e2b's spec at /sandboxes.
	for _, p := range []string{"/sandboxes", "/v2/sandboxes"} {
		mux.HandleFunc("POST "+p, s.keyed(s.create))
		mux.HandleFunc("GET "+p, s.keyed(s.list))
		mux.HandleFunc("GET "+p+"/{id}", s.keyed(s.info))
		mux.HandleFunc("DELETE "+p+"/{id}", s.keyed(s.kill))
		mux.HandleFunc("POST "+p+"/{id}/timeout", s.keyed(s.setTimeout))
		mux.HandleFunc("POST "+p+"/{id}/pause", s.keyed(s.pause))
		mux.HandleFunc("POST "+p+"/{id}/connect", s.keyed(s.connect))
		mux.HandleFunc("POST "+p+"/{id}/resume", s.keyed(s.connect))
	}
	// envd.
	opts := []connect.HandlerOption{connect.WithReadMaxBytes(maxConnectMsg), connect.WithInterceptors(errorMap{})}
	path, h := processpbconnect.NewProcessHandler(procService{s}, opts...)
	mux.Handle(path, s.sandboxed(h.ServeHTTP))
	path, h = filesystempbconnect.NewFilesystemHandler(fsService{s}, opts...)
	mux.Handle(path, s.sandboxed(h.ServeHTTP))
	mux.HandleFunc("GET /files", s.sandboxed(s.download))
	mux.HandleFunc("POST /files", s.sandboxed(s.upload))
	mux.HandleFunc("GET /health", s.sandboxed(s.health))
	return mux
}

// call is who a request is for: the credential carreld is called with,
// and the sandbox (VM) an envd request names.
type call struct {
	cred string
	vm   string
	key  identity.Token // the API key, on the control plane
}

type callKey struct{}

func withCall(ctx context.Context, c call) context.Context {
	return context.WithValue(ctx, callKey{}, c)
}

func callOf(ctx context.Context) call {
	c, _ := ctx.Value(callKey{}).(call)
	return c
}

func credOf(ctx context.Context) string { return callOf(ctx).cred }

// keyed authenticates a control-plane request by its API key.
func (s *server) keyed(next func(http.ResponseWriter, *http.Request, call)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		secret := r.Header.Get(headerAPIKey)
		if secret == "" {
			secret, _ = strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		}
		if secret == "" {
			writeError(w, http.StatusUnauthorized, "an API key is required (the X-API-KEY header; E2B_API_KEY in the SDKs)")
			return
		}
		tok, err := s.cfg.Tokens.Verify(secret)
		if err == nil && tok.Key == nil {
			err = errors.New("a VM token is not an API key: issue one with carrel key create")
		}
		if err != nil {
			writeError(w, http.StatusUnauthorized, "invalid API key: "+err.Error())
			return
		}
		c := call{cred: secret, key: tok}
		if id := r.PathValue("id"); id != "" {
			// Another key's sandbox is not found, never forbidden: a key
			// learns nothing of VMs that are not its own. carreld's policy
			// is what refuses them; this only shapes the answer.
			if !strings.HasPrefix(id, identity.KeyVMPrefix(tok.Key.Name)) || protocol.ValidVMName(id) != nil {
				writeError(w, http.StatusNotFound, "sandbox "+clip(id)+" not found")
				return
			}
			c.vm = id
		}
		next(w, r.WithContext(withCall(r.Context(), c)), c)
	}
}

// sandboxed authenticates an envd request by its sandbox token and the
// sandbox it names.
func (s *server) sandboxed(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		id := r.Header.Get(headerSandboxID)
		tok := r.Header.Get(headerToken)
		switch {
		case id == "" || protocol.ValidVMName(id) != nil:
			writeEnvdError(w, r, http.StatusBadRequest, connect.CodeInvalidArgument, "the E2b-Sandbox-Id header must name a sandbox")
			return
		case tok == "":
			writeEnvdError(w, r, http.StatusUnauthorized, connect.CodeUnauthenticated, "the X-Access-Token header is required (the sandbox's envdAccessToken)")
			return
		}
		if _, err := s.cfg.Tokens.VerifySandbox(tok, id); err != nil {
			// A token of another sandbox, or none valid: not found either way.
			writeEnvdError(w, r, http.StatusNotFound, connect.CodeNotFound, "sandbox "+id+" not found (or the access token is not its own)")
			return
		}
		next(w, r.WithContext(withCall(r.Context(), call{cred: tok, vm: id})))
	}
}

// forVM is a unary request for the call's VM.
func forVM[T any](ctx context.Context, msg *T) *connect.Request[T] {
	return client.ForVM(callOf(ctx).vm, msg)
}

// httpError is an e2b error body: {"code": 404, "message": "..."}.
type httpError struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

func writeError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(httpError{Code: status, Message: msg})
}

// writeEnvdError answers an envd request that failed before its handler:
// as a Connect error on the Connect routes, as JSON on the others.
func writeEnvdError(w http.ResponseWriter, r *http.Request, status int, code connect.Code, msg string) {
	if strings.HasPrefix(r.URL.Path, "/process.") || strings.HasPrefix(r.URL.Path, "/filesystem.") {
		_ = connect.NewErrorWriter().Write(w, r, connect.NewError(code, errors.New(msg)))
		return
	}
	writeError(w, status, msg)
}

// writeCarrelError answers with the HTTP form of an error of carreld's.
func writeCarrelError(w http.ResponseWriter, err error) {
	writeError(w, httpStatus(connect.CodeOf(err)), message(err))
}

// httpStatus is the HTTP status of a connect code, as e2b's API uses them.
func httpStatus(code connect.Code) int {
	switch code {
	case connect.CodeInvalidArgument, connect.CodeOutOfRange:
		return http.StatusBadRequest
	case connect.CodeUnauthenticated:
		return http.StatusUnauthorized
	case connect.CodePermissionDenied:
		return http.StatusForbidden
	case connect.CodeNotFound:
		return http.StatusNotFound
	case connect.CodeAlreadyExists, connect.CodeFailedPrecondition, connect.CodeAborted:
		return http.StatusConflict
	case connect.CodeResourceExhausted:
		return http.StatusTooManyRequests
	case connect.CodeUnavailable:
		return http.StatusServiceUnavailable
	case connect.CodeDeadlineExceeded:
		return http.StatusGatewayTimeout
	}
	return http.StatusInternalServerError
}

// message is err's text without connect's code prefix.
func message(err error) string {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Message()
	}
	return err.Error()
}

// errorMap gives envd clients carreld's errors as they are; only what
// would tell a key about VMs not its own becomes NotFound.
type errorMap struct{}

func (errorMap) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		resp, err := next(ctx, req)
		return resp, mapErr(err)
	}
}

func (errorMap) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (errorMap) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		return mapErr(next(ctx, conn))
	}
}

func mapErr(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		if strings.Contains(ce.Message(), "(rule carrel.api.key_vm)") {
			return connect.NewError(connect.CodeNotFound, errors.New("sandbox not found"))
		}
		return ce
	}
	return connect.NewError(connect.CodeInternal, err)
}

func newSandboxID(keyName string) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return identity.KeyVMPrefix(keyName) + hex.EncodeToString(b[:])
}

func clip(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}
