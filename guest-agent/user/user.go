// Package user looks users up in /etc/passwd and /etc/group, for running
// commands as them. It parses the files itself: the agent is static and the
// minimal image has no NSS. Cache keeps what it found until either file
// changes, for the agent, which looks a user up for every command.
package user

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
)

const (
	// MaxFileBytes caps how much of /etc/passwd or /etc/group is read.
	MaxFileBytes = 1 << 20
	// MaxGroups caps the supplementary groups of one user.
	MaxGroups = 256
	// maxSpec caps a user name or uid in a request.
	maxSpec = 256
)

// ErrUnknown is returned when no user has the name, or a spec is neither a
// name nor a uid.
var ErrUnknown = errors.New("unknown user")

// User is what a command needs to run as someone.
type User struct {
	// Name is empty for a numeric uid with no passwd entry.
	Name  string
	UID   uint32
	GID   uint32
	Home  string
	Shell string
	// Groups are the supplementary groups: the primary group first, then
	// every group that lists the user as a member.
	Groups []uint32
}

// Env returns HOME, and USER, LOGNAME and SHELL where known.
func (u *User) Env() []string {
	env := []string{"HOME=" + u.Home}
	if u.Name != "" {
		env = append(env, "USER="+u.Name, "LOGNAME="+u.Name)
	}
	if u.Shell != "" {
		env = append(env, "SHELL="+u.Shell)
	}
	return env
}

// Files names the passwd and group files; the zero value means /etc/passwd
// and /etc/group.
type Files struct {
	Passwd string
	Group  string
}

// Lookup finds a user by name, or by uid when spec is all digits. A uid with
// no passwd entry is still a user: its primary group is the uid's number, its
// home is /, and it has no name. The error wraps ErrUnknown when nobody
// matches.
func (f Files) Lookup(spec string) (*User, error) {
	if spec == "" || len(spec) > maxSpec || strings.ContainsAny(spec, ":\n\x00") {
		return nil, fmt.Errorf("%w %q", ErrUnknown, truncate(spec))
	}
	uid, numeric := parseID(spec)
	var u *User
	err := readLines(orDefault(f.Passwd, "/etc/passwd"), func(fields []string) bool {
		if len(fields) < 7 {
			return true
		}
		id, ok := parseID(fields[2])
		if !ok || (numeric && id != uid) || (!numeric && fields[0] != spec) {
			return true
		}
		gid, ok := parseID(fields[3])
		if !ok {
			return true
		}
		u = &User{Name: fields[0], UID: id, GID: gid, Home: fields[5], Shell: fields[6]}
		return false
	})
	if err != nil {
		return nil, err
	}
	if u == nil {
		if !numeric {
			return nil, fmt.Errorf("%w %q", ErrUnknown, truncate(spec))
		}
		return &User{UID: uid, GID: uid, Home: "/", Groups: []uint32{uid}}, nil
	}
	if u.Home == "" {
		u.Home = "/"
	}
	if u.Groups, err = f.groups(u.Name, u.GID); err != nil {
		return nil, err
	}
	return u, nil
}

// groups returns gid followed by the groups that list name as a member.
func (f Files) groups(name string, gid uint32) ([]uint32, error) {
	groups := []uint32{gid}
	err := readLines(orDefault(f.Group, "/etc/group"), func(fields []string) bool {
		if len(fields) < 4 {
			return true
		}
		id, ok := parseID(fields[2])
		if !ok || id == gid {
			return true
		}
		for m := range strings.SplitSeq(fields[3], ",") {
			if m == name {
				groups = append(groups, id)
				break
			}
		}
		return len(groups) < MaxGroups
	})
	if errors.Is(err, os.ErrNotExist) {
		return groups, nil // no group file: only the primary group
	}
	return groups, err
}

// readLines calls fn with the colon-separated fields of each line of path
// until fn returns false. Blank lines, comments and NIS entries are skipped.
func readLines(path string, fn func(fields []string) bool) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("read users: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(io.LimitReader(f, MaxFileBytes))
	sc.Buffer(make([]byte, 4096), 64<<10)
	for sc.Scan() {
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 || line[0] == '#' || line[0] == '+' || line[0] == '-' {
			continue
		}
		if !fn(strings.Split(string(line), ":")) {
			return nil
		}
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("read %s: %w", path, err)
	}
	return nil
}

// parseID parses a uid or gid; (uint32)(-1) is not one.
func parseID(s string) (uint32, bool) {
	if s == "" || s[0] < '0' || s[0] > '9' {
		return 0, false
	}
	n, err := strconv.ParseUint(s, 10, 32)
	if err != nil || n == 1<<32-1 {
		return 0, false
	}
	return uint32(n), true
}

func orDefault(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

func truncate(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}
