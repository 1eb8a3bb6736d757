// Package client is the Go SDK for carreld's API on its unix socket; the
// carrel CLI is built on it. Besides the generated service clients (VMs,
// Images, System, and the guest's Files and Agent services relayed by
// carreld), it has the operations a harness needs: Run (an interactive or
// detached command), Upload and Download (files, atomic in the guest),
// UploadTree and DownloadTree (directories as tar), ListProcesses and
// Signal. See the examples.
package client

import (
	"context"
	"errors"
	"net"
	"net/http"
	"os"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/gen/agentv1/agentv1connect"
	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/gen/apiv1/apiv1connect"
)

// DefaultSocket is where carreld listens unless told otherwise.
const DefaultSocket = "/run/carrel/carrel.sock"

// ValidVMName reports whether name can name a VM: 1-63 characters of
// lower-case letters, digits and '-', starting with a letter. carreld
// applies the same rule.
func ValidVMName(name string) error { return protocol.ValidVMName(name) }

// SocketFromEnv returns $CARREL_SOCKET, or DefaultSocket.
func SocketFromEnv() string {
	if s := os.Getenv("CARREL_SOCKET"); s != "" {
		return s
	}
	return DefaultSocket
}

// Client holds a client for each service.
type Client struct {
	VMs    apiv1connect.VMServiceClient
	Images apiv1connect.ImageServiceClient
	System apiv1connect.SystemServiceClient
	// Files is the guest agent's file service, relayed by carreld. Each
	// call names its VM in the Carrel-Vm header; the methods in files.go
	// do that for you.
	Files agentv1connect.FileServiceClient
	// Agent is the guest agent's own service (interactive processes,
	// process lists, signals), relayed the same way.
	Agent agentv1connect.AgentServiceClient
	// Ports is the guest agent's port service, relayed the same way;
	// DialPort wraps it in a net.Conn.
	Ports agentv1connect.PortServiceClient
	// Policies installs, binds and evaluates policies; Tokens issues the
	// VM-scoped tokens agent harnesses call with.
	Policies apiv1connect.PolicyServiceClient
	Tokens   apiv1connect.TokenServiceClient
	// GPUs lists the host's GPUs, for carrel vm create --gpu.
	GPUs apiv1connect.GPUServiceClient

	hc *http.Client
}

// CloseIdleConnections closes the connections to carreld that carry no
// call, so that carreld can let go of them: a long-lived program done
// with carreld for now should call it. The client stays usable.
func (c *Client) CloseIdleConnections() { c.hc.CloseIdleConnections() }

// An Option configures a Client.
type Option func(*options)

type options struct {
	token string
	creds func(context.Context) string
	dial  func(context.Context) (net.Conn, error)
}

// WithToken makes every call carry "Authorization: Bearer token": the
// caller is then the token's holder, limited to the token's VM, instead
// of the local user.
func WithToken(token string) Option { return func(o *options) { o.token = token } }

// WithCredentials is WithToken with the token taken from each call's
// context: a server that makes calls for its own callers (carreld's e2b
// API) passes each caller's credential along. A call whose context gives
// "" fails before it is sent.
func WithCredentials(creds func(context.Context) string) Option {
	return func(o *options) { o.creds = creds }
}

// WithDialer connects to carreld with dial instead of the socket path.
func WithDialer(dial func(context.Context) (net.Conn, error)) Option {
	return func(o *options) { o.dial = dial }
}

// TokenFromEnv returns $CARREL_TOKEN.
func TokenFromEnv() string { return os.Getenv("CARREL_TOKEN") }

// maxResponseBytes caps one message from carreld.
const maxResponseBytes = 4 << 20

// New returns a client for the carreld serving on the unix socket at path.
// It speaks gRPC over cleartext HTTP/2, so streaming calls work both ways.
func New(path string, opt ...Option) *Client {
	var o options
	for _, f := range opt {
		f(&o)
	}
	p := new(http.Protocols)
	p.SetUnencryptedHTTP2(true)
	dial := o.dial
	if dial == nil {
		dial = func(ctx context.Context) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", path)
		}
	}
	hc := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) { return dial(ctx) },
		Protocols:   p,
	}}
	const base = "http://carreld"
	// No compression: a local socket gains nothing from it.
	opts := []connect.ClientOption{connect.WithGRPC(), connect.WithReadMaxBytes(maxResponseBytes), connect.WithAcceptCompression("gzip", nil, nil)}
	switch {
	case o.creds != nil:
		opts = append(opts, connect.WithInterceptors(ctxBearer(o.creds)))
	case o.token != "":
		opts = append(opts, connect.WithInterceptors(bearer(o.token)))
	}
	return &Client{
		VMs:    apiv1connect.NewVMServiceClient(hc, base, opts...),
		Images: apiv1connect.NewImageServiceClient(hc, base, opts...),
		System: apiv1connect.NewSystemServiceClient(hc, base, opts...),
		Files:  agentv1connect.NewFileServiceClient(hc, base, opts...),
		Agent:  agentv1connect.NewAgentServiceClient(hc, base, opts...),
		Ports:  agentv1connect.NewPortServiceClient(hc, base, opts...),

		Policies: apiv1connect.NewPolicyServiceClient(hc, base, opts...),
		Tokens:   apiv1connect.NewTokenServiceClient(hc, base, opts...),
		GPUs:     apiv1connect.NewGPUServiceClient(hc, base, opts...),

		hc: hc,
	}
}

// bearer adds the token to every call, unary and streaming.
type bearer string

func (b bearer) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		req.Header().Set("Authorization", "Bearer "+string(b))
		return next(ctx, req)
	}
}

func (b bearer) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		conn.RequestHeader().Set("Authorization", "Bearer "+string(b))
		return conn
	}
}

func (bearer) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// ctxBearer adds the token each call's context gives.
type ctxBearer func(context.Context) string

var errNoCredentials = connect.NewError(connect.CodeUnauthenticated, errors.New("no credentials for this call"))

func (b ctxBearer) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		tok := b(ctx)
		if tok == "" {
			return nil, errNoCredentials
		}
		req.Header().Set("Authorization", "Bearer "+tok)
		return next(ctx, req)
	}
}

func (b ctxBearer) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		// With no token the call goes out bare, and the server, which
		// never trusts a connection of this kind by itself, refuses it.
		if tok := b(ctx); tok != "" {
			conn.RequestHeader().Set("Authorization", "Bearer "+tok)
		}
		return conn
	}
}

func (ctxBearer) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}
