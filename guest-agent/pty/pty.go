//go:build linux

// Package pty allocates pseudo-terminals through /dev/ptmx, in pure Go.
package pty

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// MaxSize is the largest number of rows or columns a terminal can have.
const MaxSize = 0xffff

// ptmx is the multiplexer; initsys links /dev/ptmx to /dev/pts/ptmx.
const ptmx = "/dev/ptmx"

// Open returns a new terminal: the master, which the agent reads and writes
// (non-blocking, so read deadlines work), and the slave, for the child's
// standard streams. Neither becomes the agent's controlling terminal.
func Open() (master, slave *os.File, err error) {
	master, err = os.OpenFile(ptmx, os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("open pty: %w", err)
	}
	var n uint32
	err = control(master, func(fd int) error {
		if err := unix.IoctlSetPointerInt(fd, unix.TIOCSPTLCK, 0); err != nil { // unlockpt
			return fmt.Errorf("unlock pty: %w", err)
		}
		var err error
		if n, err = unix.IoctlGetUint32(fd, unix.TIOCGPTN); err != nil { // ptsname
			return fmt.Errorf("pty number: %w", err)
		}
		return nil
	})
	if err == nil {
		slave, err = os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|unix.O_NOCTTY, 0)
	}
	if err != nil {
		master.Close()
		return nil, nil, fmt.Errorf("open pty: %w", err)
	}
	return master, slave, nil
}

// SetSize sets the terminal's size; the kernel sends SIGWINCH to its
// foreground process group. f may be either end.
func SetSize(f *os.File, rows, cols uint32) error {
	if rows == 0 || cols == 0 || rows > MaxSize || cols > MaxSize {
		return fmt.Errorf("terminal size %dx%d: %w", rows, cols, ErrBadSize)
	}
	return control(f, func(fd int) error {
		return unix.IoctlSetWinsize(fd, unix.TIOCSWINSZ, &unix.Winsize{Row: uint16(rows), Col: uint16(cols)})
	})
}

// ErrBadSize is returned for a size of zero or more than MaxSize.
var ErrBadSize = errors.New("rows and columns must be 1 to 65535")

// Size returns the terminal's rows and columns.
func Size(f *os.File) (rows, cols uint32, err error) {
	err = control(f, func(fd int) error {
		ws, err := unix.IoctlGetWinsize(fd, unix.TIOCGWINSZ)
		if err == nil {
			rows, cols = uint32(ws.Row), uint32(ws.Col)
		}
		return err
	})
	return rows, cols, err
}

// EOF returns the terminal's end-of-file character (VEOF, normally ^D),
// which ends a read at the start of a line in canonical mode.
func EOF(f *os.File) byte {
	eof := byte(4)
	_ = control(f, func(fd int) error {
		t, err := unix.IoctlGetTermios(fd, unix.TCGETS)
		if err == nil && t.Cc[unix.VEOF] != 0 { // 0 is _POSIX_VDISABLE
			eof = t.Cc[unix.VEOF]
		}
		return err
	})
	return eof
}

// control runs fn on f's descriptor without f.Fd, which would make the
// descriptor blocking and so disable deadlines.
func control(f *os.File, fn func(fd int) error) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var ferr error
	if err := rc.Control(func(fd uintptr) { ferr = fn(int(fd)) }); err != nil {
		return err
	}
	return ferr
}
