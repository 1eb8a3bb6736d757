// Package identity tells carreld who is calling: the process at the other
// end of the unix socket (SO_PEERCRED, read once per connection), or the
// holder of a bearer token scoped to one VM.
package identity

import (
	"context"
	"errors"
	"net"
	"net/http"
	"os/user"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/carrel-os/carrel/guest-agent/protocol"
	"github.com/carrel-os/carrel/supervisor/audit"
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
	// Groups names the primary and supplementary groups (SO_PEERGROUPS,
	// also taken at connect time); a gid without a name is its number.
	Groups []string
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
	var gids []uint32
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = syscall.GetsockoptUcred(int(fd), syscall.SOL_SOCKET, syscall.SO_PEERCRED)
		if cerr == nil {
			gids, cerr = peerGroups(int(fd))
		}
	}); err != nil || cerr != nil {
		return ctx
	}
	p := Peer{UID: cred.Uid, GID: cred.Gid, PID: cred.Pid, Groups: []string{groupName(cred.Gid)}}
	for _, g := range gids {
		if n := groupName(g); !slices.Contains(p.Groups, n) {
			p.Groups = append(p.Groups, n)
		}
	}
	return context.WithValue(ctx, peerKey{}, p)
}

// peerGroups reads SO_PEERGROUPS: the peer's supplementary gids as they
// were when it connected (Linux 4.13 and later).
func peerGroups(fd int) ([]uint32, error) {
	buf := make([]uint32, 64)
	for {
		n := uint32(len(buf) * 4)
		_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), unix.SOL_SOCKET, unix.SO_PEERGROUPS,
			uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&n)), 0)
		switch {
		case errno == unix.ERANGE && int(n/4) > len(buf) && n <= 65536*4:
			buf = make([]uint32, n/4)
			continue
		case errno != 0:
			return nil, errno
		}
		return buf[:n/4], nil
	}
}

var groupNames sync.Map // gid -> name; /etc/group is read once per gid

// groupName names a gid from the group database, or gives its number.
func groupName(gid uint32) string {
	if n, ok := groupNames.Load(gid); ok {
		return n.(string)
	}
	name := strconv.FormatUint(uint64(gid), 10)
	if g, err := user.LookupGroupId(name); err == nil {
		name = g.Name
	}
	groupNames.Store(gid, name)
	return name
}

// PeerFrom returns the credentials ConnContext stored.
func PeerFrom(ctx context.Context) (Peer, bool) {
	p, ok := ctx.Value(peerKey{}).(Peer)
	return p, ok
}

// Authenticate returns the caller of a request: the token holder when the
// request carries "Authorization: Bearer ...", otherwise the socket peer.
// A key's sandbox token is checked against the VM the Carrel-Vm header
// names, and scoped to it.
// A token that is present but not valid is an error, never a fall back to
// the peer's identity.
func Authenticate(ctx context.Context, h http.Header, tokens *Tokens) (audit.Caller, error) {
	if auth := h.Get("Authorization"); auth != "" {
		secret, ok := strings.CutPrefix(auth, "Bearer ")
		if !ok {
			return audit.Caller{}, errors.Join(ErrUnauthenticated, errors.New("the Authorization header must be \"Bearer <token>\""))
		}
		if tokens == nil {
			return audit.Caller{}, errors.Join(ErrUnauthenticated, errors.New("tokens are not enabled"))
		}
		secret = strings.TrimSpace(secret)
		if strings.HasPrefix(secret, sandboxPrefix) {
			vm := h.Get(protocol.VMHeader)
			t, err := tokens.VerifySandbox(secret, vm)
			if err != nil {
				return audit.Caller{}, err
			}
			return keyCaller(t, vm), nil
		}
		t, err := tokens.Verify(secret)
		if err != nil {
			return audit.Caller{}, err
		}
		if t.Key != nil {
			return keyCaller(t, ""), nil
		}
		return audit.Caller{Type: audit.CallerToken, TokenID: t.ID, VM: t.VM}, nil
	}
	p, ok := PeerFrom(ctx)
	if !ok {
		return audit.Caller{}, errors.Join(ErrUnauthenticated, errors.New("no peer credentials on this connection and no token"))
	}
	return audit.Caller{Type: audit.CallerPeer, UID: p.UID, GID: p.GID, PID: p.PID, Groups: p.Groups}, nil
}

type callerKey struct{}

// WithCaller stores the authenticated caller for handlers further in.
func WithCaller(ctx context.Context, c audit.Caller) context.Context {
	return context.WithValue(ctx, callerKey{}, c)
}

// CallerFrom returns the caller WithCaller stored.
func CallerFrom(ctx context.Context) (audit.Caller, bool) {
	c, ok := ctx.Value(callerKey{}).(audit.Caller)
	return c, ok
}
