// Package identity tells carreld who is calling: the process at the other
// end of the unix socket (SO_PEERCRED, read once per connection), or the
// holder of a bearer token scoped to one VM.
package identity

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strings"
	"syscall"

	"github.com/carrel-os/carrel/policy"
)

// ErrUnauthenticated is returned when a call carries neither usable peer
// credentials nor a valid token.
var ErrUnauthenticated = errors.New("unauthenticated")

type peerKey struct{}

// Peer is a connecting process's credentials, as the kernel reported them
// when it connected.
type Peer struct {
	UID, GID uint32
	PID      int32
}

// ConnContext is an http.Server ConnContext: it reads the peer's
// credentials once, when the connection is accepted. Connections that are
// not unix sockets carry none, and must bring a token.
func ConnContext(ctx context.Context, c net.Conn) context.Context {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return ctx
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return ctx
	}
	var cred *syscall.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = syscall.GetsockoptUcred(int(fd), syscall.SOL_SOCKET, syscall.SO_PEERCRED)
	}); err != nil || cerr != nil {
		return ctx
	}
	return context.WithValue(ctx, peerKey{}, Peer{UID: cred.Uid, GID: cred.Gid, PID: cred.Pid})
}

// PeerFrom returns the credentials ConnContext stored.
func PeerFrom(ctx context.Context) (Peer, bool) {
	p, ok := ctx.Value(peerKey{}).(Peer)
	return p, ok
}

// Authenticate returns the caller of a request: the token holder when the
// request carries "Authorization: Bearer ...", otherwise the socket peer.
// A token that is present but not valid is an error, never a fall back to
// the peer's identity.
func Authenticate(ctx context.Context, h http.Header, tokens *Tokens) (policy.Caller, error) {
	if auth := h.Get("Authorization"); auth != "" {
		secret, ok := strings.CutPrefix(auth, "Bearer ")
		if !ok {
			return policy.Caller{}, errors.Join(ErrUnauthenticated, errors.New("the Authorization header must be \"Bearer <token>\""))
		}
		if tokens == nil {
			return policy.Caller{}, errors.Join(ErrUnauthenticated, errors.New("tokens are not enabled"))
		}
		t, err := tokens.Verify(strings.TrimSpace(secret))
		if err != nil {
			return policy.Caller{}, err
		}
		return policy.Caller{Type: policy.CallerToken, TokenID: t.ID, VM: t.VM}, nil
	}
	p, ok := PeerFrom(ctx)
	if !ok {
		return policy.Caller{}, errors.Join(ErrUnauthenticated, errors.New("no peer credentials on this connection and no token"))
	}
	return policy.Caller{Type: policy.CallerPeer, UID: p.UID, GID: p.GID, PID: p.PID}, nil
}

type callerKey struct{}

// WithCaller stores the authenticated caller for handlers further in.
func WithCaller(ctx context.Context, c policy.Caller) context.Context {
	return context.WithValue(ctx, callerKey{}, c)
}

// CallerFrom returns the caller WithCaller stored.
func CallerFrom(ctx context.Context) (policy.Caller, bool) {
	c, ok := ctx.Value(callerKey{}).(policy.Caller)
	return c, ok
}
