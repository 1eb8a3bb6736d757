package mcpserver

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
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
// carreld as that token's holder, scoped to the token's VM: a token
// reaches its own VM alone. A session is bound to its token: another token
// cannot take it over. The MCP SDK refuses requests whose Host header is
// not a loopback name (DNS rebinding) and cross-origin browser requests.
//
// newClient returns a client that calls as token's holder. With cfg.VM
// set, only tokens for that VM are let in; without, any carrel token is,
// each session scoped to its token's VM.
func HTTP(newClient func(token string) *client.Client, cfg Config) http.Handler {
	v := &verifier{newClient: newClient, vm: cfg.VM, ok: map[string]verified{}}
	h := mcp.NewStreamableHTTPHandler(func(r *http.Request) *mcp.Server {
		ti := auth.TokenInfoFromContext(r.Context())
		if ti == nil {
			return nil
		}
		token, _ := ti.Extra["token"].(string)
		vm, _ := ti.Extra["vm"].(string)
		if vm == "" {
			return nil // verify names every token's VM; never serve one unscoped
		}
		return New(newClient(token), Config{VM: vm, Version: cfg.Version})
	}, &mcp.StreamableHTTPOptions{
		// An idle session ends, and with it its forwards and connections.
		SessionTimeout:        sessionIdle,
		CrossOriginProtection: http.NewCrossOriginProtection(),
		// write_file's content, encoded, and the JSON around it.
		MaxRequestBodyBytes: MaxWrite*4/3 + 1<<20,
	})
	return auth.RequireBearerToken(v.verify, &auth.RequireBearerTokenOptions{AllowMissingExpiration: true})(h)
}

// verifier checks tokens with carreld, which says whose each is: a token
// carreld knows, whose VM's policy lets it ask (and, when the server
// serves one VM, for that VM), is good. A good answer is kept for
// verifyFor, so that a session's every request does not cost a call.
type verifier struct {
	newClient func(string) *client.Client
	vm        string // the one VM served, or ""

	mu sync.Mutex
	ok map[string]verified // by token digest
}

type verified struct {
	vm string
	at time.Time
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
	info := func(vm string) *auth.TokenInfo {
		return &auth.TokenInfo{UserID: id, Extra: map[string]any{"token": token, "vm": vm}}
	}
	v.mu.Lock()
	seen, ok := v.ok[id]
	v.mu.Unlock()
	if ok && time.Since(seen.at) < verifyFor {
		return info(seen.vm), nil
	}
	c := v.newClient(token)
	defer c.CloseIdleConnections()
	resp, err := c.System.GetCaller(ctx, connect.NewRequest(&apiv1.GetCallerRequest{}))
	switch connect.CodeOf(err) {
	case connect.CodeUnauthenticated, connect.CodePermissionDenied:
		return nil, fmt.Errorf("%w: %v", auth.ErrInvalidToken, explain(err))
	}
	if err != nil {
		return nil, explain(err)
	}
	vm := resp.Msg.Vm
	switch {
	case resp.Msg.Type != "token" || vm == "":
		return nil, fmt.Errorf("%w: carreld does not take it for a token of a vm", auth.ErrInvalidToken)
	case v.vm != "" && vm != v.vm:
		return nil, fmt.Errorf("%w: a token for vm %q; this server serves vm %q", auth.ErrInvalidToken, vm, v.vm)
	}
	v.mu.Lock()
	for k, s := range v.ok {
		if time.Since(s.at) >= verifyFor {
			delete(v.ok, k)
		}
	}
	v.ok[id] = verified{vm: vm, at: time.Now()}
	v.mu.Unlock()
	return info(vm), nil
}
