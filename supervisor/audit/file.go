package audit

import (
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// file is what the committer needs of records.log and hashes.db, so that
// tests can make writes and syncs fail the way a full or failing disk does.
type file interface {
	io.Writer
	io.ReaderAt
	Sync() error // fdatasync
	Truncate(size int64) error
	Size() (int64, error)
	Close() error
}

// openFunc opens a file for appending.
type openFunc func(name string) (file, error)

func openAppend(name string) (file, error) {
	f, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	return osFile{f}, nil
}

type osFile struct{ *os.File }

var _ file = osFile{}

func (f osFile) Sync() error {
	for {
		err := unix.Fdatasync(int(f.Fd()))
		if err != unix.EINTR {
			if err != nil {
				return &os.PathError{Op: "fdatasync", Path: f.Name(), Err: err}
			}
			return nil
		}
	}
}

func (f osFile) Size() (int64, error) {
	st, err := f.Stat()
	if err != nil {
		return 0, err
	}
	return st.Size(), nil
}
