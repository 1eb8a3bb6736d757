package qemu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// procStartTime returns field 22 of /proc/PID/stat (start time in clock
// ticks) and whether the process is a zombie.
func procStartTime(pid int) (start uint64, zombie bool, err error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, false, err
	}
	// comm (field 2) may hold spaces and parens: parse after the last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, false, fmt.Errorf("parse /proc/%d/stat: no comm", pid)
	}
	f := strings.Fields(s[i+1:])
	// f[0] is field 3 (state), so field 22 is f[19].
	if len(f) < 20 {
		return 0, false, fmt.Errorf("parse /proc/%d/stat: %d fields", pid, len(f))
	}
	start, err = strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return 0, false, fmt.Errorf("parse /proc/%d/stat start time: %w", pid, err)
	}
	return start, f[0] == "Z" || f[0] == "X", nil
}

// alive reports whether pid is running and is the process that started at
// start (so a reused pid is not mistaken for ours).
func alive(pid int, start uint64) bool {
	if pid <= 0 {
		return false
	}
	got, zombie, err := procStartTime(pid)
	return err == nil && !zombie && got == start
}

// openPidfd opens a pidfd for the process pid that started at start. It
// returns -1 and no error when that process is gone: exited (a zombie
// whose parent does not reap it counts), or its pid reused, which the
// start time check after opening rules out.
func openPidfd(pid int, start uint64) (int, error) {
	fd, err := unix.PidfdOpen(pid, 0)
	if errors.Is(err, unix.ESRCH) {
		return -1, nil
	}
	if err != nil {
		return -1, fmt.Errorf("pidfd_open %d: %w", pid, err)
	}
	if !alive(pid, start) {
		unix.Close(fd)
		return -1, nil
	}
	return fd, nil
}

// waitExit blocks until the process exits or ctx ends. It uses a pidfd, so
// it works for processes that are not our children (an adopted QEMU
// belongs to init), and it sleeps in poll(2) until either the pidfd or a
// pipe that ctx's cancellation writes to is readable.
func waitExit(ctx context.Context, pid int, start uint64) error {
	fd, err := openPidfd(pid, start)
	if fd < 0 || err != nil {
		return err
	}
	defer unix.Close(fd)
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		return fmt.Errorf("pipe: %w", err)
	}
	defer unix.Close(p[0])
	woke := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		unix.Write(p[1], []byte{0})
		close(woke)
	})
	defer func() {
		if !stop() {
			<-woke // never close the fd under a write in flight
		}
		unix.Close(p[1])
	}()
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}, {Fd: int32(p[0]), Events: unix.POLLIN}}
	for {
		_, err := unix.Poll(fds, -1)
		if err != nil && !errors.Is(err, unix.EINTR) {
			return fmt.Errorf("poll pidfd: %w", err)
		}
		if fds[0].Revents != 0 {
			return nil
		}
		if fds[1].Revents != 0 {
			return ctx.Err()
		}
	}
}

// kill sends SIGKILL through a pidfd, which cannot hit a reused pid, and
// waits up to timeout for the exit.
func kill(pid int, start uint64, timeout time.Duration) error {
	fd, err := openPidfd(pid, start)
	if fd < 0 || err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0); err != nil && !errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("kill %d: %w", pid, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return waitExit(ctx, pid, start)
}
