package console

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
)

// TestReadTail: the end of what the guest printed, across the log's
// rotation, read back from the files a Recorder wrote.
func TestReadTail(t *testing.T) {
	host, guest := net.Pipe()
	path := filepath.Join(t.TempDir(), LogName)
	r, err := Record(context.Background(), func(context.Context) (net.Conn, error) { return host, nil }, path)
	if err != nil {
		t.Fatal(err)
	}
	var printed bytes.Buffer
	for i := 0; printed.Len() < MaxFileBytes+100<<10; i++ {
		line := fmt.Appendf(nil, "line %d\n", i)
		printed.Write(line)
		if _, err := guest.Write(line); err != nil {
			t.Fatal(err)
		}
	}
	guest.Close()
	<-r.Done()
	cur, _ := os.Stat(path)
	if _, err := os.Stat(path + ".1"); err != nil || cur.Size() >= 200<<10 {
		t.Fatalf("the log did not rotate: %v, %d bytes", err, cur.Size())
	}
	all := printed.Bytes()
	for _, n := range []int64{0, 100, cur.Size(), cur.Size() + 1, 512 << 10, int64(len(all)), int64(len(all)) + 1} {
		got, more, err := ReadTail(path, n)
		want := all[max(int64(len(all))-n, 0):]
		if err != nil || !bytes.Equal(got, want) || more != (n < int64(len(all))) {
			t.Errorf("last %d bytes: %d bytes, more %v, %v; want %d bytes", n, len(got), more, err, len(want))
		}
	}
	if got, more, err := ReadTail(filepath.Join(t.TempDir(), LogName), 100); len(got) != 0 || more || err != nil {
		t.Errorf("no log yet: %q %v %v", got, more, err)
	}
}
