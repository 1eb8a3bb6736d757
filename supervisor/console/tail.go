package console

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
)

// LogName is a VM's console log, in its directory.
const LogName = "console.log"

// ReadTail returns the last n bytes of the console log at path, taking
// what path lacks from the file rotated before it; more says that there
// were bytes before them. A log not written yet is empty. The bytes are
// the guest's, as it printed them.
func ReadTail(path string, n int64) (data []byte, more bool, err error) {
	cur, curMore, err := readEnd(path, n)
	if err != nil || curMore {
		return cur, curMore, err
	}
	old, oldMore, err := readEnd(path+".1", n-int64(len(cur)))
	if err != nil {
		return nil, false, err
	}
	return append(old, cur...), oldMore, nil
}

// readEnd reads the last n bytes of the file at path, and says whether it
// holds more; a missing file is empty.
func readEnd(path string, n int64) ([]byte, bool, error) {
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("read console log: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, false, fmt.Errorf("read console log: %w", err)
	}
	from := max(st.Size()-n, 0)
	b := make([]byte, st.Size()-from)
	k, err := f.ReadAt(b, from)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, false, fmt.Errorf("read console log: %w", err)
	}
	return b[:k], from > 0, nil
}
