//go:build linux

package sandbox

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"

	"github.com/landlock-lsm/go-landlock/landlock"
	llsyscall "github.com/landlock-lsm/go-landlock/landlock/syscall"
	"golang.org/x/sys/unix"
)

// handled is what the Landlock domain governs: every file-system right up
// to ABI 5, lowered to what the kernel knows (best effort). Network ports
// and IPC scopes stay ungoverned: the host's egress proxy is the network
// wall, and scoping signals would stop one command from signalling
// another's processes, each being in a domain of its own.
var handled = landlock.Config{HandledAccessFS: landlock.V5.HandledAccessFS}.BestEffort()

// Devices every command may read, write and ioctl, whatever the roots:
// what shells, terminals and most programs open.
var devices = []string{"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty", "/dev/ptmx"}

const (
	// ptsDir holds the terminals of Process calls with tty.
	ptsDir = "/dev/pts"
	// procDir is readable by every command: ps, /proc/self/fd and the
	// like.
	procDir = "/proc"
)

// ABI returns the running kernel's Landlock ABI version, and, when it is
// 0, why.
func ABI() (int, error) {
	v, err := llsyscall.LandlockGetABIVersion()
	switch {
	case err == nil && v > 0:
		return v, nil
	case errors.Is(err, unix.ENOSYS):
		return 0, errors.New("the kernel has no Landlock (CONFIG_SECURITY_LANDLOCK is off)")
	case errors.Is(err, unix.EOPNOTSUPP):
		return 0, errors.New("Landlock is built into the kernel but not enabled at boot (landlock is missing from its lsm= list)")
	case err == nil:
		err = fmt.Errorf("ABI version %d", v)
	}
	return 0, fmt.Errorf("landlock_create_ruleset(LANDLOCK_CREATE_RULESET_VERSION): %w", err)
}

// ruleset is a Landlock ruleset's file descriptor, closed once the
// sandbox it belongs to is replaced.
type ruleset struct {
	mu sync.RWMutex
	fd int // -1 once closed
}

func (r *ruleset) close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.fd >= 0 {
		unix.Close(r.fd)
		r.fd = -1
	}
}

// restrictThread puts the calling OS thread into the ruleset's Landlock
// domain. It needs no_new_privs set on the thread first. ok is false if
// the ruleset has been closed: a newer sandbox is in force.
func (r *ruleset) restrictThread() (ok bool, err error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.fd < 0 {
		return false, nil
	}
	// Without LANDLOCK_RESTRICT_SELF_TSYNC this restricts the calling
	// thread only.
	return true, llsyscall.LandlockRestrictSelf(r.fd, 0)
}

// buildRuleset makes the Landlock ruleset for the roots. Without Landlock
// it returns a nil ruleset and a Status saying why. Roots that cannot be
// opened (missing ones, mostly) are left out, which only narrows what
// commands may do, and are named in the Status.
func buildRuleset(rw, ro []string) (*ruleset, Status, error) {
	abi, err := ABI()
	if err != nil {
		return nil, Status{Detail: "no Landlock: " + err.Error() +
			"; commands run with no_new_privs only, and the file service alone enforces the roots"}, nil
	}
	var rules []landlock.Rule
	var skipped []string
	nrw, nro := 0, 0
	for _, p := range rw {
		dir, err := isDir(p)
		if err != nil {
			skipped = append(skipped, p)
			continue
		}
		nrw++
		if dir {
			r := landlock.RWDirs(p).WithIoctlDev()
			if abi >= 2 {
				// Renames and links across directories. ABI 1 cannot
				// grant it (they are always refused there), and asking
				// would make best effort drop Landlock altogether.
				r = r.WithRefer()
			}
			rules = append(rules, r.IgnoreIfMissing())
		} else {
			rules = append(rules, landlock.RWFiles(p).WithIoctlDev().IgnoreIfMissing())
		}
	}
	for _, p := range ro {
		dir, err := isDir(p)
		if err != nil {
			skipped = append(skipped, p)
			continue
		}
		nro++
		if dir {
			rules = append(rules, landlock.RODirs(p).IgnoreIfMissing())
		} else {
			rules = append(rules, landlock.ROFiles(p).IgnoreIfMissing())
		}
	}
	for _, p := range devices {
		if dir, err := isDir(p); err == nil && !dir {
			rules = append(rules, landlock.RWFiles(p).WithIoctlDev().IgnoreIfMissing())
		}
	}
	if dir, err := isDir(ptsDir); err == nil && dir {
		rules = append(rules, landlock.PathAccess(llsyscall.AccessFSReadFile|llsyscall.AccessFSWriteFile|
			llsyscall.AccessFSReadDir|llsyscall.AccessFSTruncate|llsyscall.AccessFSIoctlDev, ptsDir).IgnoreIfMissing())
	}
	if dir, err := isDir(procDir); err == nil && dir {
		rules = append(rules, landlock.RODirs(procDir).IgnoreIfMissing())
	}

	fd, _, err := handled.NewRulesetFD(rules...)
	if err != nil {
		return nil, Status{}, err
	}
	if fd < 0 {
		// Best effort found nothing it could enforce at this ABI.
		return nil, Status{ABI: abi, Detail: fmt.Sprintf(
			"no Landlock: ABI %d cannot express the sandbox; commands run with no_new_privs only, and the file service alone enforces the roots", abi)}, nil
	}
	detail := fmt.Sprintf("Landlock ABI %d: commands confined to %d read-write and %d read-only roots; secret paths are refused by the file service only",
		abi, nrw, nro)
	if len(skipped) > 0 {
		detail += "; roots left out (missing or unreadable): " + strings.Join(skipped, ", ")
	}
	return &ruleset{fd: fd}, Status{Landlock: true, ABI: abi, Detail: detail}, nil
}

// isDir reports whether p (following symlinks, as Landlock does) is a
// directory.
func isDir(p string) (bool, error) {
	fi, err := os.Stat(p)
	if err != nil {
		return false, err
	}
	return fi.IsDir(), nil
}
