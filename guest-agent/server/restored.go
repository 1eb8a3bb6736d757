//go:build linux

package server

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
	"unsafe"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	agentv1 "github.com/carrel-os/carrel/guest-agent/gen/agentv1"
)

// The kernel's random ioctls (linux/random.h), which x/sys/unix lacks.
const (
	rndAddEntropy = 0x40085203 // _IOW('R', 0x03, int[2])
	rndReseedCRNG = 0x5207     // _IO('R', 0x07)
)

// Bounds on Restored's seed.
const (
	minSeed = 32
	maxSeed = 512
)

// MachineIDPath is where a fork's new machine id goes.
var MachineIDPath = "/etc/machine-id"

// Restored makes a guest started from a snapshot its own again: the host's
// seed is credited to the kernel's input pool and the CRNG reseeded from
// it, so that two forks never draw the same random bytes; the clock jumps
// to the host's; a fork's new machine id is written. Each step is tried;
// the answer says which took.
func (s *service) Restored(_ context.Context, req *connect.Request[agentv1.RestoredRequest]) (*connect.Response[agentv1.RestoredResponse], error) {
	m := req.Msg
	if n := len(m.GetSeed()); n < minSeed || n > maxSeed {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("restored: a seed of %d bytes, want %d to %d", n, minSeed, maxSeed))
	}
	if id := m.GetMachineId(); id != "" && !validMachineID(id) {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("restored: machine id is not 32 lowercase hex digits"))
	}
	if m.GetUnixNanos() <= 0 {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("restored: no host time"))
	}
	resp := &agentv1.RestoredResponse{}
	var failed []string
	if err := reseed(m.GetSeed()); err != nil {
		failed = append(failed, "rng: "+err.Error())
	} else {
		resp.Reseeded = true
	}
	ts := unix.NsecToTimespec(m.GetUnixNanos())
	if err := unix.ClockSettime(unix.CLOCK_REALTIME, &ts); err != nil {
		failed = append(failed, "clock: "+err.Error())
	} else {
		resp.ClockSet = true
	}
	if id := m.GetMachineId(); id != "" {
		if err := writeMachineID(MachineIDPath, id); err != nil {
			failed = append(failed, "machine id: "+err.Error())
		} else {
			resp.MachineIdSet = true
		}
	}
	resp.Detail = strings.Join(failed, "; ")
	s.cfg.Log.Info("restored from a snapshot", "reseeded", resp.Reseeded, "clock", time.Unix(0, m.GetUnixNanos()).UTC(),
		"new_machine_id", resp.MachineIdSet, "failed", resp.Detail)
	return connect.NewResponse(resp), nil
}

// reseed credits seed to the kernel's input pool and forces the CRNG to
// reseed from it at once, instead of at its next scheduled reseed.
func reseed(seed []byte) error {
	f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	// struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
	info := make([]byte, 8+len(seed))
	binary.NativeEndian.PutUint32(info[0:], uint32(len(seed)*8))
	binary.NativeEndian.PutUint32(info[4:], uint32(len(seed)))
	copy(info[8:], seed)
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), rndAddEntropy, uintptr(unsafe.Pointer(&info[0]))); errno != 0 {
		return fmt.Errorf("RNDADDENTROPY: %w", errno)
	}
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), rndReseedCRNG, 0); errno != 0 {
		return fmt.Errorf("RNDRESEEDCRNG: %w", errno)
	}
	return nil
}

func validMachineID(id string) bool {
	if len(id) != 32 {
		return false
	}
	for _, c := range id {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// writeMachineID replaces path with id, atomically.
func writeMachineID(path, id string) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".machine-id-")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.WriteString(id + "\n"); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(0o444); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}
