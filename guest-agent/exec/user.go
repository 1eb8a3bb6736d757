//go:build linux

package exec

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"syscall"

	"connectrpc.com/connect"

	"github.com/carrel-os/carrel/guest-agent/user"
)

// geteuid is replaced by tests that play an agent without root.
var geteuid = os.Geteuid

// resolveUser returns the user a request runs as, and the credential to
// start it with.
//
// Only root can run commands as someone else. An agent that is not root (a
// development host, unit tests) runs every command as itself: a request
// naming no user gets the agent's own user, and one naming any uid but the
// agent's is refused with CodePermissionDenied.
func (r *Runner) resolveUser(spec string) (*user.User, *syscall.Credential, error) {
	if spec == "" {
		spec = r.User
	}
	euid := geteuid()
	if euid != 0 && spec == "" {
		u, err := r.users.Lookup(r.Users, strconv.Itoa(euid))
		if err != nil { // no passwd file: the environment still works
			u = &user.User{UID: uint32(euid), GID: uint32(os.Getegid()), Home: "/"}
			if home := os.Getenv("HOME"); home != "" {
				u.Home = home
			}
		}
		return u, nil, nil
	}
	if spec == "" {
		spec = DefaultUser
	}
	u, err := r.users.Lookup(r.Users, spec)
	switch {
	case errors.Is(err, user.ErrUnknown):
		return nil, nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("exec: %w", err))
	case err != nil:
		return nil, nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("exec: look up user: %w", err))
	case euid != 0 && u.UID != uint32(euid):
		return nil, nil, connect.NewError(connect.CodePermissionDenied,
			fmt.Errorf("exec: the agent runs as uid %d, not root, so it cannot run commands as uid %d", euid, u.UID))
	case euid != 0:
		return u, nil, nil
	}
	return u, &syscall.Credential{Uid: u.UID, Gid: u.GID, Groups: u.Groups}, nil
}
