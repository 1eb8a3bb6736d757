package mcpserver

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/modelcontextprotocol/go-sdk/auth"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/carrel-os/carrel/supervisor/client"
	"github.com/carrel-os/carrel/supervisor/gen/apiv1"
)

// HTTP serves the tools over MCP's streamable HTTP transport. Every
// request carries a carrel token as its bearer token ("Authorization:
// Bearer carrel_..."), which carreld checks (a request without one, or
// with one carreld does not know, gets 401), and each session's tools call
// carreld as that token's holder, so that a token scoped to one VM reaches
// that VM alone. A session is bound to its token: another token cannot
// take it over. The MCP SDK refuses requests whose Host header is not a
// loopback name (DNS rebinding) and cross-origin browser requests.
//
// newClient returns a client that calls as token's holder; cfg.VM must
// name the VM the tokens are checked against.
func HTTP(newClient func(token string) *client.Client, cfg Config) (http.Handler, error) {
	if cfg.VM == "" {
		return nil, errors.New("serving over http needs a vm (--vm): tokens are checked against it")
	}
	v := &verifier{newClient: newClient, vm: cfg.VM, ok: map[string]time.Time{}}
	h := mcp.NewStreamableHTTPHandler(func(r *http.Request) *mcp.Server {
		ti := auth.TokenInfoFromContext(r.Context())
		if ti == nil {
			return nil
		}
		token, _ := ti.Extra["token"].(string)
		return New(newClient(token), cfg)
	}, &mcp.StreamableHTTPOptions{
		// An idle session ends, and with it its forwards and connections.
		SessionTimeout:        sessionIdle,
		CrossOriginProtection: http.NewCrossOriginProtection(),
		// write_file's content, encoded, and the JSON around it.
		MaxRequestBodyBytes: MaxWrite*4/3 + 1<<20,
	})
	return auth.RequireBearerToken(v.verify, &auth.RequireBearerTokenOptions{AllowMissingExpiration: true})(h), nil
}

// verifier checks tokens with carreld: a token that may read its VM's
// record is good. A good answer is kept for verifyFor, so that a session's
// every request does not cost a call.
type verifier struct {
	newClient func(string) *client.Client
	vm        string

	mu sync.Mutex
	ok map[string]time.Time // token digest -> when checked
}

const verifyFor = 30 * time.Second

// sessionIdle ends an HTTP session no request has used for that long.
const sessionIdle = 30 * time.Minute

func (v *verifier) verify(ctx context.Context, token string, _ *http.Request) (*auth.TokenInfo, error) {
	if !strings.HasPrefix(token, "carrel_") || len(token) > 256 {
		return nil, fmt.Errorf("%w: not a carrel token (carrel token create VM)", auth.ErrInvalidToken)
	}
	sum := sha256.Sum256([]byte(token))
	id := hex.EncodeToString(sum[:])
	info := &auth.TokenInfo{UserID: id, Extra: map[string]any{"token": token}}
	v.mu.Lock()
	at, seen := v.ok[id]
	v.mu.Unlock()
	if seen && time.Since(at) < verifyFor {
		return info, nil
	}
	c := v.newClient(token)
	defer c.CloseIdleConnections()
	_, err := c.VMs.GetVM(ctx, connect.NewRequest(&apiv1.GetVMRequest{Name: v.vm}))
	switch connect.CodeOf(err) {
	case connect.CodeUnauthenticated, connect.CodePermissionDenied:
		return nil, fmt.Errorf("%w: %v", auth.ErrInvalidToken, explain(err))
	}
	if err != nil {
		return nil, explain(err)
	}
	v.mu.Lock()
	for k, t := range v.ok {
		if time.Since(t) >= verifyFor {
			delete(v.ok, k)
		}
	}
	v.ok[id] = time.Now()
	v.mu.Unlock()
	return info, nil
}
